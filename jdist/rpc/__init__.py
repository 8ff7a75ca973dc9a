"""jdist.rpc (in progress)."""
