"""The ``jdist-run`` launcher and :func:`spawn` for tests and notebooks."""

from jdist.launch._spawn import SpawnError as SpawnError
from jdist.launch._spawn import free_port as free_port
from jdist.launch._spawn import spawn as spawn

__all__ = ["spawn", "SpawnError", "free_port"]
