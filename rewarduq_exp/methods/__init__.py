"""The ``method`` config group: uncertainty-aware reward models behind one contract (``base.RewardMethod``).

Layer 5: may import the foundation, ``runs``, ``data``, ``metrics`` and ``models``; never the runner."""
