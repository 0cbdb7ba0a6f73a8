"""Imported once, by the tests' fork server only (``tests/child_processes.py``): the modules a child of the tests
needs (those of ``train.py`` / ``evaluate.py`` and the methods), so that each child starts with them imported instead
of importing them again (seconds per child on 2 cores).

Nothing here may initialise CUDA (every child would inherit it): imports only, no model, no tensor on a device, no
``torch.cuda.is_available()``. A module that fails to import is skipped: its children import it themselves (and fail
there, in the test that needs it, with the real error).
"""

import importlib
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as tests/conftest.py, if this runs outside a test session

MODULES = [
    "torch", "torch.distributed", "torch.multiprocessing",
    "transformers", "transformers.models.qwen3.modeling_qwen3", "transformers.trainer",
    "datasets", "accelerate", "peft", "trl.trainer.dpo_trainer", "trl.trainer.dpo_config", "wandb",
    "hydra", "omegaconf", "hydra_plugins.rewarduq_launchers.skip_completed",
    "rewarduq_exp.runner.cli", "rewarduq_exp.runner.train_run", "rewarduq_exp.runner.evaluate_run",
    "rewarduq_exp.methods.ens_mlp", "rewarduq_exp.methods.bay_lin", "rewarduq_exp.methods.ens_lora",
    "rewarduq_exp.methods.mcd_dpo", "rewarduq_exp.methods.borp_method", "rewarduq_exp.methods.label_ranking",
    "entry_points",
]

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 (skipped: see above)
        pass

try:  # Hydra's plugin scan (imports every launcher / sweeper plugin), done by the first command otherwise
    from hydra.core.plugins import Plugins

    Plugins.instance()
except Exception:  # noqa: BLE001
    pass
