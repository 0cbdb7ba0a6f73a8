"""The optimiser settings of every method we train ourselves (:class:`TrainingSchedule`), checked in one place.

Free of torch: a method's settings (:mod:`rewarduq_exp.methods.settings`) build and check their schedule before any
model exists; :func:`~rewarduq_exp.methods.base.run_training` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from rewarduq_exp.core.checks import check_adam_betas, check_choice, check_max_grad_norm, check_positive
from rewarduq_exp.core.errors import UserError

LR_SCHEDULES = ("cosine", "constant")


@dataclass
class TrainingSchedule:
    """AdamW with a cosine schedule and linear warm-up (RewardUQ Appendix B.2), gradients clipped to a total L2 norm
    of ``max_grad_norm`` before each step (None: no clipping). The authors trained every method with the Hugging Face
    Trainer, which clips at 1.0 by default, so Table 1's values were tuned with clipping at 1.0."""

    learning_rate: float
    batch_size: int = 64
    num_epochs: float = 1.0
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    lr_schedule: str = "cosine"     # or "constant" (the label-ranking learners: plain Adam, appendix C)

    @classmethod
    def of(cls, settings, **fixed) -> TrainingSchedule:
        """The schedule of a method's ``settings``: each of its fields the settings have, then ``fixed`` (what the
        method does not let its config change, e.g. the label-ranking nets' constant learning rate)."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)}
        if "adam_betas" in values:
            values["adam_betas"] = tuple(values["adam_betas"])
        return cls(**{**values, **fixed})

    def validate(self, prefix: str = "method") -> None:
        """The real-valued settings and their combinations; ``batch_size`` is a whole number, checked by the bound on
        the settings' field (``PAIRS_PER_STEP`` of :mod:`rewarduq_exp.methods.settings`)."""
        check_positive(self.learning_rate, f"{prefix}.learning_rate")
        check_choice(f"{prefix}.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_positive(self.num_epochs, f"{prefix}.num_epochs")
        if not 0 <= self.warmup_ratio < 1:
            raise UserError(f"{prefix}.warmup_ratio={self.warmup_ratio} is invalid: must be in [0, 1)")
        check_positive(self.weight_decay, f"{prefix}.weight_decay", inclusive=True)
        check_max_grad_norm(self.max_grad_norm, f"{prefix}.max_grad_norm")
        check_adam_betas(self.adam_betas, f"{prefix}.adam_betas")
