"""Policy optimisation against a trained reward model, measured against the world's gold (``downstream.py task=rl``)."""
