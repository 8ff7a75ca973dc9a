"""Init sync: check that every process wrapped the same model, then broadcast rank 0's.

torch prints the mismatch on one rank and lets the others hang until the timeout; here
every process gathers every process's parameter description (paths, shapes, dtypes), so
all of them raise the same :class:`~jdist.errors.ModelMismatchError`, naming the first
differing path and each rank's entry. Then parameters (and buffers) are broadcast from
process 0.

Both steps run as small ``shard_map`` programs over the group's mesh (bytes move through
XLA, as every other collective). With a single process there is nothing to do.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist._donation import trim_host_memory
from jdist._runs import consecutive
from jdist.collectives.runtime import ProcessGroup, uncommitted
from jdist.ddp._buckets import LeafInfo
from jdist.ddp._placement import local_first, per_replica
from jdist.errors import ModelMismatchError

__all__ = ["CHUNK_BYTES", "describe", "first_difference", "gather_bytes", "check_same_model",
           "broadcast_from_rank0", "init_sync"]


def describe(leaves: Sequence[LeafInfo]) -> list[list]:
    """A JSON-able description: ``[[path, shape, dtype], ...]``."""
    return [[x.path, list(x.shape), x.dtype] for x in leaves]


def first_difference(descs: Sequence[list[list]]) -> str | None:
    """``None`` if all ranks' descriptions agree, else a message naming the difference."""
    ref = descs[0]
    for r, d in enumerate(descs[1:], start=1):
        if d == ref:
            continue
        for k in range(max(len(ref), len(d))):
            a = ref[k] if k < len(ref) else None
            b = d[k] if k < len(d) else None
            if a != b:
                break
        per_rank = "; ".join(
            f"rank {i}: " + (
                f"{x[k][0]!r} shape {tuple(x[k][1])} dtype {x[k][2]}" if k < len(x)
                else f"no parameter #{k} (only {len(x)} parameters)")
            for i, x in enumerate(descs))
        return (
            f"DDP expects the same model on every process, but parameter #{k} differs "
            f"between rank 0 and rank {r} ({len(ref)} vs {len(d)} parameters in all). "
            f"{per_rank}. Build the same model (same layers, shapes and dtypes) on every "
            f"process before wrapping it in DistributedDataParallel."
        )
    return None


@functools.lru_cache(maxsize=16)
def _gather_program(mesh: Any, ax: str):
    def gather(x):
        return jax.lax.all_gather(x, ax, tiled=True)

    return jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P(ax), out_specs=P(),
                                 check_vma=False))


def gather_bytes(group: ProcessGroup, data: bytes) -> list[bytes]:
    """Every process's ``data``, in group-rank order (an in-graph all-gather)."""
    n_local = len(group.local_devices)
    prog = _gather_program(group.mesh, group.axis_name)
    lengths = np.asarray(prog(per_replica(np.asarray([len(data)], np.int32), group)))
    lengths = lengths.reshape(-1)
    # widths rounded up to a power of two: models of similar size share one program
    width = 1 << max(6, int(lengths.max() - 1).bit_length())
    buf = np.zeros((1, width), np.uint8)
    buf[0, :len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(prog(per_replica(buf, group)))
    rows = rows.reshape(group.num_replicas, width)
    out = []
    for r in range(group.size()):
        i = r * n_local
        out.append(rows[i, :int(lengths[i])].tobytes())
    return out


def check_same_model(group: ProcessGroup, leaves: Sequence[LeafInfo]) -> None:
    """Raise :class:`ModelMismatchError` on every process if the models differ."""
    if group.size() == 1:
        return
    mine = json.dumps(describe(leaves)).encode()
    descs = [json.loads(b.decode()) for b in gather_bytes(group, mine)]
    msg = first_difference(descs)
    if msg is not None:
        raise ModelMismatchError(msg)


def broadcast_from_rank0(group: ProcessGroup, tree: Any) -> Any:
    """Process 0's values of ``tree`` on every process (process-local arrays)."""
    if group.size() == 1 or not jax.tree.leaves(tree):
        return tree
    ax = group.axis_name
    from jdist.ddp._program import broadcast_from_first

    def body(t):
        t = jax.tree.map(lambda x: x[0], t)
        return jax.tree.map(lambda x: x[None], broadcast_from_first(t, ax))

    prog = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P(ax), out_specs=P(ax),
                                 check_vma=False))
    return local_first(prog(per_replica(tree, group)))


def _uncommitted(x: Any) -> Any:
    """``x``'s value as an array on no device in particular (JAX's default device,
    uncommitted): jitted code puts it wherever its other arguments live."""
    if not isinstance(x, jax.Array):
        return x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_uncommitted(jax.random.key_data(x)),
                                        impl=jax.random.key_impl(x))
    return uncommitted(np.array(x))  # a host copy: the new array owns its memory


CHUNK_BYTES = 64 << 20
"""Init sync broadcasts the model in groups of leaves of at most this many bytes (a
leaf larger than that alone): each group's staging copies are freed before the next, so
the sync's peak memory is the model twice (the old values and rank 0's) plus a few
groups, not the model five times."""


def _nbytes(x: Any) -> int:
    try:
        return int(x.nbytes)
    except Exception:  # noqa: BLE001 - a key array, a Python scalar: small
        return 0


def _chunks(leaves: list, limit: int) -> list[list[int]]:
    """Leaf indices in consecutive groups of at most ``limit`` bytes (one leaf at least)."""
    return consecutive([_nbytes(x) for x in leaves], limit)


def _synced(group: ProcessGroup, tree: Any) -> Any:
    """Rank 0's values of ``tree``, uncommitted, broadcast group of leaves by group."""
    leaves, tdef = jax.tree.flatten(tree)
    out: list = [None] * len(leaves)
    for idx in _chunks(leaves, CHUNK_BYTES):
        got = broadcast_from_rank0(group, [leaves[i] for i in idx])
        for i, x in zip(idx, got, strict=True):
            out[i] = _uncommitted(x)
    return jax.tree.unflatten(tdef, out)


def init_sync(group: ProcessGroup, leaves: Sequence[LeafInfo], params: Any,
              buffers: Any) -> tuple[Any, Any]:
    """Check the model across processes, then return rank 0's ``(params, buffers)``.

    The values are uncommitted arrays, as a freshly initialized module's are, so the
    module stays usable by any jitted code: the user's own ``@nnx.jit`` step over a
    ``ddp.shard_batch`` batch (global arrays on the group's mesh), or an optimizer fed
    gradients on this process's device (distributed autograd)."""
    check_same_model(group, leaves)
    out = tuple(_synced(group, t) for t in (params, buffers))
    trim_host_memory()  # the staging copies' pages (see jdist/_donation.py)
    return out
