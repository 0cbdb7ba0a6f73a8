"""A run whose features are all cached loads only what it needs (issue 45): no tokenizer, so ``transformers`` is never
imported, and no chat template is rendered; its training imports no torch._dynamo; its metrics are the first run's,
exactly."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, cache_with_tiny_model
from entry_points import run_entry_point

SMALL = ["progress=false", "dataset.n_train=200", "dataset.n_eval=100", "dataset.n_ood=100", "metric.diagrams=false"]

# python train.py, plus one line on stderr at exit saying which of the heavy libraries the process imported. atexit:
# train.py leaves through sys.exit, and the line must come after everything the run did.
WRAPPER = """
import atexit, runpy, sys
atexit.register(lambda: print("IMPORTED=" + ",".join(sorted(
    m for m in ("transformers", "tokenizers", "jinja2", "torch._dynamo", "datasets") if m in sys.modules)),
    file=sys.stderr))
sys.argv = sys.argv[1:]
sys.path.insert(0, {root!r})
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.e2e
def test_cached_run_imports_no_tokenizer_and_repeats_the_metrics(tmp_path, tiny_backbone):
    cache = cache_with_tiny_model(tmp_path / "cache", tiny_backbone)
    common = [f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={cache}", "method=ens_mlp", *SMALL]
    first = run_entry_point(ROOT / "train.py", [*common, f"hydra.run.dir={tmp_path / 'first'}"], tmp_path)
    assert first.returncode == 0, first.stderr
    second = subprocess.run([sys.executable, "-c", WRAPPER.format(root=str(ROOT)), str(ROOT / "train.py"), *common,
                             f"hydra.run.dir={tmp_path / 'second'}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr
    # neither transformers, tokenizers nor jinja2; nor torch._dynamo (torch.optim's optimizers import it: 0.8 s) nor
    # datasets (the synthetic world needs neither)
    assert second.stderr.strip().splitlines()[-1] == "IMPORTED="
    status = json.loads((tmp_path / "second" / "status.json").read_text())
    assert status["conversations"] == {"rendered": 0, "recorded": 0}
    assert status["features"]["backbone_forward_passes"] == 0 and status["features"]["cache_misses"] == 0
    assert status["token_count_cache"] == {"hits": 0, "misses": 0}  # the length filter counted nothing either
    first_metrics = json.loads((tmp_path / "first" / "metrics.json").read_text())
    assert json.loads((tmp_path / "second" / "metrics.json").read_text()) == first_metrics
