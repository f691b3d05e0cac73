"""Score: prediction rows to metrics and task tables, in pure Python (no torch); ``python -m evaluate.score``
rescores a run without its model."""
