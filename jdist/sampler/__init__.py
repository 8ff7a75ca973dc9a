"""jdist.sampler (in progress)."""
