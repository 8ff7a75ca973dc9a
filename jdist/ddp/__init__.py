"""jdist.ddp (in progress)."""
