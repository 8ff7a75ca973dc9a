"""``batches``: a sampler plus in-memory arrays -> process-local batches, prefetched.

For files larger than memory, resumable state at the batch in hand, or batches split
over the devices the way DDP wants them, see :class:`jdist.sampler.ArrayLoader` and
:class:`jdist.sampler.ResumableLoader` (docs/data.md).

Deliberately small: no workers, no collation hooks, no transforms. It gathers rows of
numpy arrays (any pytree of them) in the sampler's order, one fixed-size batch at a
time, and puts the next batch on the devices while the caller works on the current one
(JAX transfers are asynchronous, so ``device_put`` returns at once).
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

__all__ = ["batches"]


def _leaves(arrays):
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(arrays)
    if not leaves:
        raise ValueError("arrays is an empty pytree; pass at least one array")
    leaves = [np.asarray(x) for x in leaves]
    length = leaves[0].shape[0] if leaves[0].ndim else None
    for x in leaves:
        if x.ndim == 0 or x.shape[0] != length:
            shapes = [tuple(y.shape) for y in leaves]
            raise ValueError(
                f"every array needs the same leading (sample) dimension; got shapes "
                f"{shapes}"
            )
    return leaves, treedef, length


def _to_devices(batch, sharding):
    import jax

    if sharding is None:
        return jax.device_put(batch)
    if getattr(sharding, "is_fully_addressable", True):
        return jax.device_put(batch, sharding)
    # a sharding over several processes: each process gives its own rows
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(sharding, x), batch
    )


def batches(
    sampler, arrays, batch_size: int, *, drop_last: bool = False,
    prefetch: bool = True, sharding=None,
):
    """Yield batches of ``arrays`` (rows picked by ``sampler``), prefetched to devices.

    Args:
      sampler: any iterable of row indices, typically a
        :class:`~jdist.sampler.DistributedSampler`. Its progress counts rows as they
        are taken, so with ``prefetch`` its ``state_dict()`` includes the batch
        already prefetched (one ``batch_size`` ahead of the batch in hand).
      arrays: a pytree of arrays (numpy or anything ``np.asarray`` accepts) that share
        their leading dimension: the rows of this process's dataset.
      batch_size: rows per batch.
      drop_last: drop a final batch smaller than ``batch_size`` (keeps shapes fixed, so
        a jitted step does not recompile).
      prefetch: if True, yield ``jax.Array`` batches, the next one already on its way to
        the devices; if False, yield numpy batches.
      sharding: where to put batches when prefetching (a ``jax.sharding.Sharding``, for
        example ``NamedSharding(mesh, P("dp"))``); None puts them on the default device.
        A sharding spanning several processes gets each process's local rows
        (``jax.make_array_from_process_local_data``).

    Yields:
      Pytrees shaped like ``arrays`` with leading dimension ``batch_size`` (the last one
      may be shorter unless ``drop_last``).

    Examples:
      >>> data = {"x": np.arange(10) * 10}
      >>> [b["x"].tolist() for b in batches([3, 1, 4, 0, 2], data, 2, prefetch=False)]
      [[30, 10], [40, 0], [20]]
    """
    import jax

    batch_size = operator.index(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size}")
    leaves, treedef, length = _leaves(arrays)

    def host_batches():
        it = iter(sampler)
        while True:
            idx = np.fromiter(itertools.islice(it, batch_size), dtype=np.int64)
            if idx.size == 0 or (drop_last and idx.size < batch_size):
                return
            if idx.min() < -length or idx.max() >= length:
                bad = int(idx.max() if idx.max() >= length else idx.min())
                raise IndexError(
                    f"sampler gave index {bad} but the arrays have {length} rows; "
                    "build the sampler over len(arrays)"
                )
            yield jax.tree_util.tree_unflatten(treedef, [x[idx] for x in leaves])
            if idx.size < batch_size:
                return

    if not prefetch:
        yield from host_batches()
        return
    pending = None
    for batch in host_batches():
        ready = _to_devices(batch, sharding)
        if pending is not None:
            yield pending
        pending = ready
    if pending is not None:
        yield pending
