"""Experiment loggers (the ``logger`` config group): ``none`` (default) and ``wandb`` (online or offline).

The run folder is always the record; wandb mirrors it (config, training curve, metrics, calibration diagrams).
A wandb run is always finished, also when the run fails, so the next job of an in-process sweep starts clean.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError, first_line


class NullLogger:
    def log_history(self, history: list[dict]) -> None: ...

    def log_metrics(self, dataset: str, metrics: dict, figures: list[Path]) -> None: ...

    def log_summary(self, info: dict) -> None: ...

    def finish(self, failed: bool = False) -> None: ...


class WandbLogger(NullLogger):
    def __init__(self, logger_cfg, run_cfg, out_dir: Path, run_name: str):
        try:
            import wandb
        except ImportError:
            raise UserError("logger=wandb needs the wandb package: pip install -e '.[wandb]'") from None
        self.wandb = wandb
        kwargs = dict(project=logger_cfg.project, entity=logger_cfg.entity, group=logger_cfg.group,
                      tags=list(logger_cfg.tags or []), name=run_name, dir=str(out_dir), job_type="train",
                      config=OmegaConf.to_container(run_cfg, resolve=True))
        if logger_cfg.mode:
            kwargs["mode"] = str(logger_cfg.mode)
        try:
            self.run = wandb.init(**kwargs)
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as err:
            # No API key (and no terminal to ask for one), or a malformed one: wandb stops before any network call
            # with a traceback; the fix is one of three settings, named here.
            raise UserError(f"logger=wandb cannot log in ({first_line(err)}): run `wandb login` (or set "
                            "WANDB_API_KEY), or log offline with WANDB_MODE=offline (or logger.mode=offline) and "
                            "`wandb sync` later, or use logger=none") from None

    def log_history(self, history):
        for record in history:
            step = record["step"]
            self.run.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=step)

    def log_metrics(self, dataset, metrics, figures):
        payload = {f"{dataset}/{k}": v for k, v in metrics.items()}
        payload.update({f"{dataset}/{Path(f).stem}": self.wandb.Image(str(f)) for f in figures})
        self.run.log(payload)
        for k, v in metrics.items():
            self.run.summary[f"{dataset}/{k}"] = v

    def log_summary(self, info):
        for k, v in info.items():
            if isinstance(v, (int, float, str, bool)):
                self.run.summary[k] = v

    def finish(self, failed=False):
        self.run.finish(exit_code=1 if failed else 0)


def make_logger(run_cfg, out_dir: Path, run_name: str):
    name = run_cfg.logger.name
    if name == "none":
        return NullLogger()
    if name == "wandb":
        return WandbLogger(run_cfg.logger, run_cfg, out_dir, run_name)
    raise UserError(f"logger={name} is not supported; allowed: none, wandb")
