"""rewarduq_exp: uncertainty-aware reward models, run from Hydra configs (train.py, evaluate.py) or from Python.

    import rewarduq_exp as r
    model = r.load_run("outputs/runs/<run>")
    model.score(["What is 2+2?"], ["4"])

The Python API (rewarduq_exp/api.py) is imported on first use, so the command-line entry points, which import this
package before Hydra has parsed the command line, do not pay for torch and transformers there. ``UserError`` (a
``ValueError``) is what every bad input raises: one line that names the problem and the allowed values.
"""

from rewarduq_exp.core.errors import UserError  # light: no torch; callers catch it (``except r.UserError``)

__all__ = ["RewardModel", "TRLRewardFunction", "UserError", "load_run"]
_API = ("RewardModel", "TRLRewardFunction", "load_run")


def __getattr__(name: str):
    if name in _API:
        from rewarduq_exp import api

        return getattr(api, name)
    raise AttributeError(f"module 'rewarduq_exp' has no attribute {name!r}")
