"""The ``model`` config group: backbones (hub, local or the tiny offline Qwen3), token counting, and the frozen
features read from a backbone through the shared feature cache (the ``probe`` config group).

Layer 4: may import the foundation, ``runs``, ``data``, ``ranking`` and ``metrics``; never methods or the runner."""
