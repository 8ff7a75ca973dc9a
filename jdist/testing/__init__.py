"""jdist.testing (in progress)."""
