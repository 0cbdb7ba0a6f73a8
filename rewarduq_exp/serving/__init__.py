"""A trained run's reward model over HTTP (``serve.py``): OpenRLHF's remote reward-model protocol and a route of its
own, both with the uncertainty beside the reward; concurrent requests merged into batches (docs/serving.md)."""
