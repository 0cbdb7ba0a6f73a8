"""What happens after the runs: the selection rule over a sweep, the paper's tables and figures.

Layer 6: reads run folders (``runs``) and computes with ``metrics``; never trains or loads a model."""
