"""Checks across processes: the replicas of a DDP module agree, and so do batch sizes.

DDP keeps one replicated copy of the parameters. A step that changes them outside DDP
without reducing gradients across processes (the user's own ``@nnx.jit`` train step fed
each process's own batch) leaves each process with other values behind the same
"replicated" global array, and JAX cannot tell. The engine calls :func:`check_replicas`
when the parameters it is handed are not the arrays of its last call (they were changed
outside DDP) and the group spans several processes: one small program fingerprints each
replica's parameters (two 32-bit sums over their bits, one of them position-weighted) and
all-gathers the fingerprints, and a replica that differs from the first raises
:class:`~jdist.errors.ReplicaDivergenceError` on every process, naming the ranks. A
loop that always updates the parameters outside DDP (``ddp.value_and_grad`` and the
optimizer applied by hand) would pay that check every step; it runs at most once per
:data:`CHECK_EVERY_CALLS` collective DDP calls after the first, so drift is named within
that many steps at a bounded cost.

Invariant: the check is a collective, so whether a call runs it is decided from what
every process agrees on: it runs only on DDP calls every process makes (steps outside a
join context; forwards that broadcast buffers, not a forward one process makes alone),
and its throttle counts those calls, not seconds (a wall-clock throttle let processes
running at slightly different speeds decide differently, and the one that checked
waited for partners that never came: tests/ddp/test_replica_check_schedule.py,
tests/ddp/test_flax_habits.py::test_manual_optimizer_with_one_slower_process_checks_replicas_alike).

:class:`ProcessChecks` also agrees on the batch size: at the first step and whenever
this process's batch size changes, one small all-gather compares every process's, and
unequal sizes raise a ``ValueError`` naming them and ``pad_batch_to`` instead of running
programs of different shapes (which gloo answers by aborting the process).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist.collectives.runtime import ProcessGroup
from jdist.ddp._sync import gather_bytes
from jdist.errors import ReplicaDivergenceError

__all__ = ["fingerprint", "check_replicas", "ProcessChecks", "DIVERGED_MSG", "CHECK_EVERY_CALLS"]

CHECK_EVERY_CALLS = 16

DIVERGED_MSG = (
    "the parameters of this DDP module differ between processes: rank(s) {ranks} hold "
    "other values than rank 0 ({first}). They were changed outside DDP by a step that did "
    "not reduce gradients across processes, e.g. an @nnx.jit train_step(model, optimizer, "
    "batch) called with each process's own batch, so each process trained on its own "
    "data. Call that step with ddp.shard_batch(batch) (the global batch split over the "
    "replicas: XLA then averages the gradients over every process), or train with "
    "ddp.train_step(loss_fn, optimizer) / ddp.value_and_grad(loss_fn).")


def _bits(x: jax.Array) -> jax.Array:
    """``x``'s bits as uint32 words, in ``x``'s shape (8-byte values: a trailing axis of
    two words); exact: any change of a value changes them. Not flattened: a reshape
    would make XLA materialize the words (a copy of every parameter)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)


def _flat_index(shape: tuple) -> jax.Array:
    """Each element's row-major position, as uint32, in ``shape`` (from iotas: fused into
    the reduction, never materialized)."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(
            stride % (1 << 32))
        stride *= shape[d]
    return idx


def fingerprint(leaves: Sequence[jax.Array]) -> jax.Array:
    """Two uint32 words over every leaf's bits: their sum and a position-weighted sum
    (both wrapping), so a change of any value, or values swapped, changes the result.
    One variadic reduction per leaf over its own shape: no temporary of its size."""
    total = jnp.zeros((2,), jnp.uint32)
    for k, x in enumerate(leaves):
        u = _bits(x)
        if u.ndim == 0:
            u = u[None]
        w = _flat_index(u.shape) * jnp.uint32(2) + jnp.uint32(2 * k + 1)
        s1, s2 = jax.lax.reduce((u, u * w), (jnp.uint32(0), jnp.uint32(0)),
                                lambda p, q: (p[0] + q[0], p[1] + q[1]),
                                tuple(range(u.ndim)))
        total = total + jnp.stack([s1, s2])
    return total


@functools.lru_cache(maxsize=16)
def _program(mesh: Any, axis: str):
    def body(leaves):
        return jax.lax.all_gather(fingerprint(leaves), axis)

    # without type checks: each replica's parameters are typed replicated, which is
    # exactly what is being checked here
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                                 check_vma=False))


def check_replicas(group: ProcessGroup, params: Any) -> None:
    """Raise :class:`ReplicaDivergenceError` on every process when the replicas of
    ``params`` (global arrays replicated over ``group``'s devices) differ."""
    leaves = [x for x in jax.tree.leaves(params) if np.size(x)]
    if not leaves or group.size() == 1:
        return
    prints = np.asarray(_program(group.mesh, group.axis_name)(leaves))
    rank_of = {d: r for r, devs in enumerate(group.devices_per_rank) for d in devs}
    per_rank: dict[int, np.ndarray] = {}
    for i, d in enumerate(group.mesh.devices.flat):
        per_rank.setdefault(rank_of[d], prints[i])
    bad = [r for r in range(group.size()) if not np.array_equal(per_rank[r], per_rank[0])]
    if bad:
        raise ReplicaDivergenceError(DIVERGED_MSG.format(
            ranks=", ".join(map(str, bad)), first=f"fingerprint {per_rank[0].tolist()}"))


class ProcessChecks:
    """One DDP engine's checks across processes (none with one process)."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self._seen: list | None = None  # the parameters after the last collective call
        self._calls = 0  # collective DDP calls so far (the same count on every process)
        self._checked_at: int | None = None  # the call that last checked the replicas
        self._rows: str | None = None  # the batch shapes every process agreed on last

    def seen(self, params: Any, *, collective: bool = True) -> None:
        """The parameters as the last collective DDP call left them (a call one process
        makes alone does not move the baseline, or that process alone would find them
        unchanged at the next collective call)."""
        if collective:
            self._seen = jax.tree.leaves(params)

    def replicas(self, module_params: Any, placed: Any, *, collective: bool) -> None:
        """When the module's parameters are not the arrays of the last DDP call (changed
        outside DDP), check that every process holds the same values (``placed``: them
        as global replicated arrays); at most once per :data:`CHECK_EVERY_CALLS`
        collective calls after the first check. ``collective``: every process makes
        this call (a step outside join, a forward that broadcasts buffers); no other
        call checks, as a process checking alone would wait for the others."""
        if self.group.size() == 1 or not collective:
            return
        call, self._calls = self._calls, self._calls + 1
        leaves, seen = jax.tree.leaves(module_params), self._seen
        if seen is not None and len(seen) == len(leaves) and all(
                a is b for a, b in zip(leaves, seen, strict=True)):
            return
        if self._checked_at is not None and call - self._checked_at < CHECK_EVERY_CALLS:
            return
        self._checked_at = call
        check_replicas(self.group, placed)

    def rows(self, batch: Any) -> None:
        """At the first step and whenever this process's batch shapes change: every
        process has as many rows, and leaves of the same shapes and dtypes, or
        ``ValueError`` naming each rank's and the fix. (Steps only: a forward without
        buffers to broadcast communicates nothing, and an evaluation over unequal shares,
        ``even_split=False``, is fine there.)

        Shapes beyond the rows matter too: each process compiles its step for its own
        shapes, and two programs whose collectives have equal sizes (a SyncBatchNorm's
        per-feature sums) may issue them in different orders, pairing the wrong values.
        """
        if self.group.size() == 1:
            return
        leaves = jax.tree.leaves(batch)
        rows = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else -1
        sig = f"{rows}|" + ";".join(
            f"{tuple(np.shape(x))[1:]}:{np.result_type(x)}" for x in leaves)
        if sig == self._rows:
            return
        got = [b.decode() for b in gather_bytes(self.group, sig.encode())]
        if len(set(got)) > 1:
            raise ValueError(_shapes_message(got, len(self.group.local_devices)))
        self._rows = sig


def _shapes_message(sigs: list[str], per: int) -> str:
    """The error for processes whose step inputs differ (``sigs``: each rank's
    ``"rows|shape:dtype;..."``)."""
    rows = [int(s.split("|", 1)[0]) for s in sigs]
    if len(set(rows)) > 1:
        pad = -(-max(max(rows), 1) // per) * per
        sizes = ", ".join(f"rank {r}: {n}" for r, n in enumerate(rows))
        return (
            f"DDP needs the same batch size on every process, got {sizes} rows. Every "
            "process runs the same compiled step; for batches of different sizes (an "
            f"empty one included) pass train_step(loss_fn, optimizer, pad_batch_to={pad}) "
            "with a per-example loss (padding is masked out exactly, SyncBatchNorm "
            "included), or split the data evenly (DistributedSampler with "
            "drop_last=True, or the loader's drop_last).")
    shapes = ", ".join(f"rank {r}: [{s.split('|', 1)[1]}]" for r, s in enumerate(sigs))
    return (
        "DDP needs inputs of the same shapes and dtypes on every process (beyond the "
        f"batch dimension), got per-example shapes {shapes}. Every process runs the same "
        "compiled step: pad the inputs to one shape (and mask the padding in the loss and "
        "in statistics, e.g. SyncBatchNorm's mask=...), or resize them.")
