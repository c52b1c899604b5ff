"""Tools around the engine: the memory estimator (``zero-estimate``) and per-rank memory accounting."""
