"""Recalibration of a trained reward model's probabilities and intervals, fitted on a calibration split after
training (temperature, isotonic where the data supports it, an interval scale by EBCE or with a conformal risk
guarantee), saved as ``<run>/calibration.json`` and applied wherever scores are read."""

from rewarduq_exp.recalibration.calibration_file import (  # noqa: F401
    CALIBRATION_FILE,
    Calibration,
    read_calibration,
    save_calibration,
)
from rewarduq_exp.recalibration.fit import (  # noqa: F401
    fit_calibration,
    recalibrate_settings,
    recalibrated_metrics,
    recalibrated_pointwise_metrics,
)
