"""jdist.dp (in progress)."""
