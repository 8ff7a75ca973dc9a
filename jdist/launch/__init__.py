"""The ``jdist-run`` launcher and :func:`spawn` for tests and notebooks."""

from jdist.launch._env import xla_flags_with_devices as xla_flags_with_devices
from jdist.launch._forkserver import set_forkserver_preload as set_forkserver_preload
from jdist.launch._spawn import SpawnError as SpawnError
from jdist.launch._spawn import spawn as spawn
from jdist.store import free_port as free_port

__all__ = ["spawn", "set_forkserver_preload", "SpawnError", "free_port",
           "xla_flags_with_devices"]
