"""Where the Hydra config tree (``conf/``) is: the one place that decides it.

Everything that reads the configs outside Hydra's own composition in ``train.py`` (dataset and method names, the
loaders a run folder may build, the command-line checks, the planner, the backbone shapes) goes through
:data:`CONF_DIR`:

* run from a checkout (an editable install, or the repository on ``sys.path``): the repository's ``conf/``, beside
  the package, so an edited config counts at once;
* installed (``pip install .``, a wheel): the copy the wheel ships inside the package, ``rewarduq_exp/conf``
  (``setup.py`` maps the repository's ``conf/`` there), so ``load_run`` and the checks work from any directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def find_conf_dir() -> Path:
    """The repository's ``conf/`` when this package sits in a checkout (its parent holds ``pyproject.toml`` and
    ``conf/train.yaml``), else the config tree packaged inside the installed package."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "conf" / "train.yaml").is_file():
        return checkout / "conf"
    # A package installed by pip is a folder of files, and Hydra reads configs from a folder: a plain path.
    return Path(str(resources.files("rewarduq_exp") / "conf"))


CONF_DIR = find_conf_dir()
