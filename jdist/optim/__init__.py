"""jdist.optim (in progress)."""
