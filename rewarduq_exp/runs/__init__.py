"""Run folders and their records: atomic writes, run identity (config hash, folder names), the folder a run writes
(status, metrics, predictions, model), reading finished runs back, and the outcome of a sweep.

Layer 1: imports only the foundation modules (``errors``, ``distributed``)."""
