"""Place a pytree on a group's mesh, one full copy per device (``P()``), across processes.

What a step program over ``group.mesh`` wants for parameters and optimizer state. Each
process builds the global array from copies on its own devices of the mesh
(``jax.make_array_from_single_device_arrays``), so no bytes cross processes and no
value is compared: the caller promises that every process holds the same values (what
an eager ``broadcast`` or ``jdist.optim.broadcast_parameters`` gives). ``jax.device_put``
onto a sharding spanning processes would instead check that with a collective per leaf
(for uncommitted arrays) or refuse (for committed ones).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jdist.collectives._group import ProcessGroup, resolve_group

__all__ = ["place_replicated"]


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def place_replicated(tree: Any, group: ProcessGroup | None = None) -> Any:
    """Every array leaf of ``tree`` as a global array replicated over ``group.mesh``.

    Args:
      tree: a pytree; array leaves (numpy, ``jax.Array``, typed PRNG keys) are placed,
        other leaves (Python numbers, None) are kept. Every process of the group must
        hold the same values.
      group: a ``ProcessGroup`` or None (the default group; without
        ``init_process_group`` the embedded group over this process's devices).

    Returns:
      The same structure; placed leaves have ``NamedSharding(group.mesh, P())``.

    Raises:
      ValueError: a leaf is already a global array spanning other processes with another
        sharding (re-placing it would move bytes between processes); the message names
        its sharding.
    """
    g = resolve_group(group)
    sharding = NamedSharding(g.mesh, PartitionSpec())
    mine = set(g.local_devices)
    devs = [d for d in g.mesh.devices.flat if d in mine]

    def one(x):
        if not _is_array(x):
            return x
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            if not x.is_fully_addressable:
                raise ValueError(
                    f"place_replicated: a leaf of shape {x.shape} is a global array with "
                    f"sharding {x.sharding}, spanning other processes; gather it first "
                    f"(jax.experimental.multihost_utils.process_allgather) or pass this "
                    f"process's copy")
        else:
            x = jax.numpy.asarray(x)
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [jax.device_put(x, d) for d in devs])

    return jax.tree.map(one, tree)
