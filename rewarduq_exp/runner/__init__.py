"""What ``train.py`` and ``evaluate.py`` execute: the Hydra glue (``cli``), one training run, re-scoring a trained
run, scoring a method on eval sets, the summary table and the wandb logger.

Layer 7: the only layer that wires data, models, methods and metrics together."""
