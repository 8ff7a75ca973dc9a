"""The machinery under every eager collective: meshes, program cache, execution.

**How a process's array maps to devices.** Eager collectives count *processes*, as
torch does. Each member contributes one array, placed on its *first* local device of the
group (``group.devices_per_rank[rank][0]``); the collective runs as one jitted
``shard_map`` program over the group's *process mesh*: a 1-D mesh with exactly that
first device of each member, under the group's axis name. Results come back on the
same device. A process's other devices take no part (they are for in-graph replicas:
DDP and ``jdist.collectives.functional``), so a 2-process job with 2 devices per
process gives the same eager results as one with 1 device per process.

Programs are compiled once per (kind, op, shape, dtype, extras) and group, and cached
on the group (``group.extra["programs"]``); repeated calls only dispatch.

Every member's input is stacked as the global array ``[n, *shape]`` sharded on the
axis; a program sees ``[1, *shape]`` per member and returns ``[1, *out_shape]``.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jdist._aligned import aligned_empty
from jdist.collectives import _fingerprint as fpr
from jdist.collectives._group import (
    NON_GROUP_MEMBER,
    ProcessGroup,
    group_state,
    make_mesh,
    resolve_group,
)
from jdist.collectives._result import uncommitted
from jdist.collectives._stuck import park_if_ending
from jdist.errors import (
    CollectiveTimeoutError,
    JdistError,
    NotInitializedError,
    PeerFailedError,
)

__all__ = ["FUSE_LIMIT", "member_group", "process_mesh", "local_device", "next_seq", "program",
           "execute", "to_global", "from_block", "fingerprint_check", "stats",
           "is_runtime_failure", "peer_failure", "run", "x64"]


FUSE_LIMIT = 256 << 10  # bytes; up to this size the check is fused into the program


def member_group(group: ProcessGroup | None, what: str) -> ProcessGroup | None:
    """``group`` (or WORLD) for an eager collective; raises before init.

    ``None`` for ``NON_GROUP_MEMBER``: as in torch, a collective called on a group this
    process is not in warns and returns None (the caller returns at once).
    """
    if group is NON_GROUP_MEMBER:
        group_state.require(f"jdist.{what}")
        rank = group_state.default_group.rank
        warnings.warn(f"Running {what} on global rank {rank} which does not belong to the "
                      f"given group (NON_GROUP_MEMBER); it returns None and does nothing",
                      stacklevel=3)
        return None
    if group is None and not group_state.is_initialized():
        raise NotInitializedError(
            f"Default process group has not been initialized, please make sure to call "
            f"init_process_group. (jdist.{what} needs it; call jdist.init_process_group() "
            f"first, in every process)"
        )
    return resolve_group(group)


def _lock(group: ProcessGroup) -> threading.Lock:
    return group.extra.setdefault("_lock", threading.Lock())


def stats(group: ProcessGroup) -> dict:
    """Counters kept per group: ``compiles`` (programs built), ``calls`` (programs run),
    ``checked`` (calls whose fingerprints were compared)."""
    return group.extra.setdefault("stats", {"compiles": 0, "calls": 0, "checked": 0})


def process_mesh(group: ProcessGroup):
    """The 1-D mesh of each member's first device (see the module docstring)."""
    pm = group.extra.get("pmesh")
    if pm is None:
        pm = make_mesh([ds[0] for ds in group.devices_per_rank], group.axis_name)
        group.extra["pmesh"] = pm
    return pm


def local_device(group: ProcessGroup):
    """This process's device in the process mesh."""
    return group.devices_per_rank[group.rank][0]


def note(group: ProcessGroup, seq: int, what: str) -> None:
    """Publish (through the heartbeat) that this rank entered collective ``seq``."""
    wd = group_state.runtime.get("watchdog")
    if wd is not None:
        wd.note(group.name, seq, what, group.ranks)


def step_channel(group: ProcessGroup) -> str:
    """The progress key of ``group``'s compiled steps (DDP's), apart from its collectives."""
    return f"{group.name}#steps"


def enter_step(group: ProcessGroup, what: str) -> int:
    """Number this rank's next compiled step on ``group`` and publish it (through the
    heartbeat), so that a timed-out peer can name the rank that never entered it. Every
    member numbers the steps it runs on the group in order, as collectives are."""
    with _lock(group):
        seq = group.extra.get("step_seq", 0) + 1  # from 1, as DDP counts its steps
        group.extra["step_seq"] = seq
    wd = group_state.runtime.get("watchdog")
    if wd is not None:
        wd.note(step_channel(group), seq, what, group.ranks)
    return seq


def next_seq(group: ProcessGroup) -> int:
    """The group's next collective sequence number (same on every member)."""
    with _lock(group):
        seq = group.extra.get("seq", 0)
        group.extra["seq"] = seq + 1
    return seq


def _compile(group: ProcessGroup, full_key: tuple, fn: Callable, args: tuple) -> Callable:
    cache = group.extra.setdefault("programs", {})
    compiled = cache.get(full_key)
    if compiled is None:
        spec = PartitionSpec(group.axis_name)
        specs = tuple(spec for _ in args)
        mapped = jax.shard_map(fn, mesh=process_mesh(group), in_specs=specs,
                               out_specs=spec if len(args) == 1 else specs, check_vma=False)
        compiled = jax.jit(mapped).lower(*args).compile()
        cache[full_key] = compiled
        stats(group)["compiles"] += 1
    return compiled


def _arg(group: ProcessGroup, shape: tuple, dtype) -> jax.ShapeDtypeStruct:
    sharding = NamedSharding(process_mesh(group), PartitionSpec(group.axis_name))
    return jax.ShapeDtypeStruct((group.size(), *shape), dtype, sharding=sharding)


def program(group: ProcessGroup, key: tuple, build: Callable[[], Callable],
            shape: tuple, dtype) -> Callable:
    """The compiled program for ``key`` on ``group``, built by ``build()`` on first use.

    ``build()`` returns the per-member function ``[1, *shape] -> [1, *out]`` that runs
    inside ``shard_map`` over the process mesh (axis ``group.axis_name``).
    """
    full_key = (key, tuple(shape), np.dtype(dtype).name)
    cache = group.extra.get("programs")
    if cache is not None and full_key in cache:
        return cache[full_key]
    return _compile(group, full_key, build(), (_arg(group, shape, dtype),))


def checked_program(group: ProcessGroup, key: tuple, build: Callable[[], Callable],
                    shape: tuple, dtype) -> Callable:
    """``program`` fused with the fingerprint check: ``(fp, x) -> (fps, out)``.

    The members all-gather their fingerprints first (:func:`_slot_gather`, the same
    first collective for every checked call); the collective itself runs under
    ``lax.cond`` only when every fingerprint is equal, so members whose calls differ
    (and whose programs therefore differ after the shared first step) all skip it and
    no mismatched bytes are ever exchanged. One dispatch instead of two.
    """
    full_key = ("checked", key, tuple(shape), np.dtype(dtype).name)
    cache = group.extra.get("programs")
    if cache is not None and full_key in cache:
        return cache[full_key]
    body, axis = build(), group.axis_name

    def fused(fp, x):
        _, fps, ok = _slot_gather(axis, _fp_bytes(fp), slot_bytes(group.size()))
        return fps, jax.lax.cond(ok, body, _skip(body, x), x)

    args = (_arg(group, (fpr.FP_LEN,), np.int32), _arg(group, shape, dtype))
    return _compile(group, full_key, fused, args)


SLOT_TOTAL = 64 << 10  # bytes: the first collective of a checked call gathers at most this
SLOT_MIN = 4096  # many in all (from every member together), and at least this per member


def slot_bytes(n: int) -> int:
    """The bytes each of ``n`` members puts into the first collective of every checked
    call on a group of ``n``: ``SLOT_TOTAL // n`` (a multiple of 64), at least
    ``SLOT_MIN``. It depends on the group's size alone, so members' first collectives
    match whatever each of them calls. On 2 processes a 32 KiB slot made calls of 4 to
    32 KiB one round trip (about 0.25 ms less each) and left smaller ones as they were;
    64 KiB slowed the smallest calls (``benchmarks/collectives.py``)."""
    return max(SLOT_MIN, SLOT_TOTAL // max(int(n), 1) // 64 * 64)


def _fp_bytes(fp):
    """An int32 ``[1, FP_LEN]`` fingerprint as its ``[1, 4 * FP_LEN]`` bytes."""
    return jax.lax.bitcast_convert_type(fp, jax.numpy.uint8).reshape(1, -1)


def _slot_gather(axis: str, head, slot: int):
    """All-gather each member's ``head`` (``[1, k]`` uint8, ``k <= slot``, the fingerprint
    in its first ``4 * FP_LEN`` bytes) padded to ``slot`` bytes (:func:`slot_bytes`).

    Every checked call starts with this collective, whatever its kind, shape or dtype,
    so the members' first collectives match even when their calls do not; a call whose
    fingerprint and data fit in one slot needs no other (:func:`packed_program`).
    Returns ``(rows [n, slot], fps [1, n * FP_LEN] int32, all fingerprints equal)``.
    """
    jnp = jax.numpy
    row = jnp.pad(head, ((0, 0), (0, slot - head.shape[1])))
    rows = jax.lax.all_gather(row, axis, axis=0, tiled=True)
    fps = jax.lax.bitcast_convert_type(rows[:, : 4 * fpr.FP_LEN].reshape(-1, fpr.FP_LEN, 4),
                                       jnp.int32)
    return rows, fps.reshape(1, -1), jnp.all(fps == fps[0])


def _batches(body: Callable, axis: str, n: int, shape: tuple, dtype) -> bool:
    """Whether ``vmap`` can run ``body`` for all ``n`` members on one process."""
    try:
        jax.eval_shape(jax.vmap(body, axis_name=axis),
                       jax.ShapeDtypeStruct((n, 1, *shape), dtype))
    except Exception:  # no batching rule for one of its collectives: not one trip
        return False
    return True


def _packed_bytes(shape: tuple, dtype) -> int:
    """Bytes of a packed call's input: the fingerprint, then the data (:func:`_pack`)."""
    return 4 * fpr.FP_LEN + np.dtype(dtype).itemsize * math.prod(shape)


def _one_trip(group: ProcessGroup, key: tuple, build: Callable[[], Callable],
              shape: tuple, dtype) -> bool:
    """Whether the packed call ``(key, shape, dtype)`` is one all-gather: its fingerprint
    and data fit the group's slot and ``vmap`` can batch the body (decided once per
    group: :func:`packed_program` and the check-off path in :func:`run` ask)."""
    trips = group.extra.setdefault("one_trip", {})
    tkey = (key, shape, dtype)
    found = trips.get(tkey)
    if found is None:
        if len(trips) >= 4 * PLAN_CAP:
            trips.clear()
        found = trips[tkey] = _packed_bytes(shape, dtype) <= slot_bytes(group.size()) \
            and _batches(build(), group.axis_name, group.size(), shape, dtype)
    return found


def _skip(body: Callable, x) -> Callable:
    out_type = jax.eval_shape(body, x)
    return lambda *_: jax.numpy.zeros(out_type.shape, out_type.dtype)


STAGE_CAP = 512 << 20  # bytes of staging buffers kept per group (least recently used go)


def _stage(group: ProcessGroup, shape: tuple, dtype) -> list:
    """This group's staging entry for ``(shape, dtype)``: ``[buffer, global array]``, the
    buffer a 64-byte-aligned ``[1, *shape]`` host array, the global array (made at the
    first call) ``None`` until made, or ``False`` where it could not alias the buffer."""
    pool = group.extra.setdefault("staging", collections.OrderedDict())
    key = (tuple(shape), np.dtype(dtype).str)
    entry = pool.pop(key, None)
    if entry is None:
        nbytes = np.dtype(dtype).itemsize * math.prod(shape)
        entry = [aligned_empty((1, *shape), dtype), None]
        while pool and sum(e[0].nbytes for e in pool.values()) + nbytes > STAGE_CAP:
            pool.popitem(last=False)
    pool[key] = entry
    return entry


def _staged_global(group: ProcessGroup, x, shape: tuple, dtype) -> jax.Array | None:
    """The global ``[n, *shape]`` input holding ``x``, by a copy into this group's
    staging buffer, whose global array is made once and then reused (CPU only).

    On CPU, ``jax.device_put`` of a 64-byte-aligned numpy array aliases its memory; a
    global array over that buffer therefore reads whatever the buffer holds when a
    program runs. Making a fresh input array per call cost about half a millisecond
    per eager collective on 2 processes (a new buffer's readiness and the array's
    assembly; ``benchmarks/collectives.py``), several times the collective itself.
    Calls on a group run one at a time and each waits for its program's outputs, and
    no eager program donates its input, so one buffer per ``(shape, dtype)`` is never
    read and written at once. None when the device did not alias the buffer (then
    every call makes its own array)."""
    entry = _stage(group, shape, dtype)
    np.copyto(entry[0][0], x if isinstance(x, np.ndarray) else np.asarray(x),
              casting="unsafe")
    return _entry_global(group, entry, shape)


def _entry_global(group: ProcessGroup, entry: list, shape: tuple) -> jax.Array | None:
    """The global array over staging ``entry``'s buffer (made at the first call), or
    None when the device did not alias the buffer (see :func:`_staged_global`)."""
    if entry[1] is None:
        buf = entry[0]
        block = jax.device_put(buf, local_device(group))
        if block.unsafe_buffer_pointer() != buf.ctypes.data:
            entry[1] = False
        else:
            sharding = NamedSharding(process_mesh(group), PartitionSpec(group.axis_name))
            entry[1] = jax.make_array_from_single_device_arrays(
                (group.size(), *shape), sharding, [block])
    return entry[1] if entry[1] is not False else None


PLAN_CAP = 256  # packed plans kept per group (least recently used go); each keeps its
# staging row (at most FUSE_LIMIT bytes) alive, so at most 64 MiB outside STAGE_CAP


def _packed_plan(group: ProcessGroup, key: tuple, build: Callable[[], Callable],
                 shape: tuple, dtype) -> tuple:
    """What a packed call of ``(key, shape, dtype)`` reuses, looked up once per call:
    ``(program, staged, fp_row, data_row)``, the compiled :func:`packed_program` and,
    on CPU, the global array over a staging row with writable views of that row's
    fingerprint (int32) and data (``dtype``, ``shape``) bytes. Elsewhere, or where the
    device did not alias the row, ``staged`` and the views are None.

    Writing the two views is the whole of a call's packing: no packed copy, no
    per-call lookups of the program and buffer (about 60 us less per small call on 2
    processes, ``benchmarks/collectives.py``). Plans sharing a byte size share the
    row, as :func:`_staged_global`'s calls do, for the same reason."""
    plans = group.extra.setdefault("packed_plans", collections.OrderedDict())
    pkey = (key, shape, dtype)
    plan = plans.get(pkey)
    if plan is not None:
        plans.move_to_end(pkey)
        return plan
    fn = packed_program(group, key, build, shape, dtype)
    plan = (fn, None, None, None)
    if local_device(group).platform == "cpu":
        head, nbytes = 4 * fpr.FP_LEN, _packed_bytes(shape, dtype)
        entry = _stage(group, (nbytes,), np.uint8)
        staged = _entry_global(group, entry, (nbytes,))
        if staged is not None:
            row = entry[0][0]
            plan = (fn, staged, row[:head].view(np.int32),
                    row[head:].view(np.dtype(dtype)).reshape(shape))
    plans[pkey] = plan
    while len(plans) > PLAN_CAP:
        plans.popitem(last=False)
    return plan


def to_global(group: ProcessGroup, x, shape: tuple, dtype) -> jax.Array:
    """Stack this member's ``x`` (``shape``) into the global ``[n, *shape]`` array."""
    dev = local_device(group)
    if dev.platform == "cpu":
        staged = _staged_global(group, x, shape, dtype)
        if staged is not None:
            return staged
    if isinstance(x, jax.Array):
        block = jax.device_put(x, dev).astype(dtype).reshape((1, *shape))
    else:
        block = jax.device_put(np.asarray(x, dtype=dtype).reshape((1, *shape)), dev)
    pm = process_mesh(group)
    sharding = NamedSharding(pm, PartitionSpec(group.axis_name))
    return jax.make_array_from_single_device_arrays((group.size(), *shape), sharding,
                                                    [block])


def from_block(block: jax.Array, as_jax: bool):
    """Drop the leading member axis of this process's output block (numpy, or with
    ``as_jax`` an uncommitted jax.Array: the host block placed by
    :func:`~jdist.collectives._result.uncommitted` instead of a reshape program)."""
    if next(iter(block.devices())).platform != "cpu":
        return block.reshape(block.shape[1:]) if as_jax else np.asarray(block)[0]
    view = np.asarray(block)[0]
    return uncommitted(view) if as_jax else view


def is_runtime_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from the XLA runtime (a failed collective), not from us."""
    if isinstance(exc, JdistError):
        return False
    return isinstance(exc, (jax.errors.JaxRuntimeError, ValueError, RuntimeError)) and (
        "gloo" in str(exc).lower() or "connection" in str(exc).lower()
        or isinstance(exc, jax.errors.JaxRuntimeError))


def peer_failure(group: ProcessGroup, what: str, exc: BaseException,
                 seq: int | None = None, step: bool = False) -> JdistError:
    """The error to raise for runtime failure ``exc``: a dead rank, or a timeout.

    :class:`PeerFailedError` names ranks found dead; a gloo timeout with every rank
    alive becomes :class:`CollectiveTimeoutError` naming the ranks that never reached
    collective ``seq`` (``step``: compiled step ``seq``, :func:`enter_step`).
    """
    park_if_ending()  # (the stuck-rank deadline is ending the job: its message wins)
    wd = group_state.runtime.get("watchdog")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    timed_out = "timed out" in str(exc).lower()
    dead = wd.diagnose(group.ranks, wait=0.0 if timed_out else None) if wd else {}
    if dead:
        who = "; ".join(f"rank {r} is gone ({why})" for r, why in sorted(dead.items()))
        return PeerFailedError(
            f"{what} on group {group.name!r} failed because a peer died: {who}. Look at "
            f"that rank's own error first. (runtime error: {first})"
        )
    if timed_out:
        return CollectiveTimeoutError(
            f"{what} ({'step' if step else 'collective'} #{seq}) on group {group.name!r} "
            f"timed out after the group timeout ({group.timeout:g} s): "
            f"{behind_text(group, seq, step) or 'no rank was found behind'}. Make every "
            f"member call the same collectives, or raise init_process_group(timeout=...). "
            f"(runtime error: {first})"
        )
    return PeerFailedError(
        f"{what} on group {group.name!r} failed in the runtime and no dead rank was "
        f"found among {list(group.ranks)}: {first}"
    )


def behind_text(group: ProcessGroup, seq: int | None, step: bool = False) -> str:
    """``"rank 2 is still at step #1 (DDP step #2)"`` for each member behind ``seq``
    (of the group's collectives, or with ``step`` its compiled steps); "" if none."""
    wd = group_state.runtime.get("watchdog")
    if wd is None or seq is None:
        return ""
    behind = (wd.behind(group.ranks, step_channel(group), seq, "step") if step
              else wd.behind(group.ranks, group.name, seq))
    return "; ".join(f"rank {r} {where}" for r, where in sorted(behind.items()))


def execute(group: ProcessGroup, what: str, fn: Callable, arg, seq: int | None = None) -> Any:
    """Run ``fn`` on ``arg`` (an array or a tuple of them); return this process's blocks.

    A runtime failure (a peer closed its connection) becomes :class:`PeerFailedError`
    naming the dead rank.
    """
    stats(group)["calls"] += 1
    try:
        out = fn(*arg) if isinstance(arg, tuple) else fn(arg)
        if isinstance(out, (tuple, list)):
            blocks = tuple(o.addressable_data(0) for o in out)
            jax.block_until_ready(blocks)
            return blocks
        block = out.addressable_data(0)
        block.block_until_ready()
    except Exception as exc:
        if is_runtime_failure(exc):
            raise peer_failure(group, what, exc, seq) from exc
        raise
    return block


def fingerprint_check(group: ProcessGroup, what: str, fp: np.ndarray) -> None:
    """All-gather ``fp`` over ``group`` and raise on a mismatch (see ``_fingerprint``)."""
    axis = group.axis_name

    def build():
        return lambda x: _slot_gather(axis, _fp_bytes(x), slot_bytes(group.size()))[1]

    seq = int(fp[1])
    note(group, seq, what)
    fn = program(group, ("fingerprint",), build, (fpr.FP_LEN,), np.int32)
    block = execute(group, what, fn, to_global(group, fp, (fpr.FP_LEN,), np.int32), seq)
    fps = np.asarray(block)[0].reshape(group.size(), fpr.FP_LEN)
    stats(group)["checked"] += 1
    fpr.check(fps, group.ranks, group.name)


def x64(dtype):
    """A context enabling 64-bit types when ``dtype`` needs them and they are off."""
    if np.dtype(dtype).itemsize >= 8 and np.dtype(dtype).kind in "iufc":
        if not jax.config.jax_enable_x64:
            return jax.enable_x64(True)
    return contextlib.nullcontext()


def _unpack(raw, shape: tuple, dtype):
    """Inverse of :func:`_pack` inside the program: ``[1, 4*FP_LEN + nbytes]`` uint8."""
    jnp = jax.numpy
    fp = jax.lax.bitcast_convert_type(raw[:, : 4 * fpr.FP_LEN].reshape(1, fpr.FP_LEN, 4),
                                      jnp.int32)
    body = raw[:, 4 * fpr.FP_LEN:]
    dt = np.dtype(dtype)
    if dt == np.bool_:
        x = body != 0
    elif dt.itemsize == 1:
        x = jax.lax.bitcast_convert_type(body, dt)
    else:
        x = jax.lax.bitcast_convert_type(body.reshape(1, -1, dt.itemsize), dt)
    return fp, x.reshape((1, *shape))


def _pack(fp: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Fingerprint and data bytes in one uint8 vector: one transfer instead of two."""
    data = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    return np.concatenate([fp.astype(np.int32).view(np.uint8), data])


def packed_program(group: ProcessGroup, key: tuple, build: Callable[[], Callable],
                   shape: tuple, dtype) -> Callable:
    """:func:`checked_program` taking one packed uint8 input (see :func:`_pack`).

    When the packed bytes fit in one slot, the slot gather is the whole exchange: each
    member then computes every member's result of the body locally (the body's
    collectives batched over the gathered rows by ``vmap`` under the group's axis
    name) and keeps its own. One collective round trip instead of two. A body that
    ``vmap`` cannot batch (a partial ``ppermute``) runs as its own collective.
    """
    full_key = ("packed", key, tuple(shape), np.dtype(dtype).name)
    cache = group.extra.get("programs")
    if cache is not None and full_key in cache:
        return cache[full_key]
    body, axis = build(), group.axis_name
    nbytes, slot = _packed_bytes(shape, dtype), slot_bytes(group.size())
    one_trip = _one_trip(group, key, build, shape, dtype)

    def fused(raw):
        x = _unpack(raw, shape, dtype)[1]
        if not one_trip:
            _, fps, ok = _slot_gather(axis, raw[:, : 4 * fpr.FP_LEN], slot)
            return fps, jax.lax.cond(ok, body, _skip(body, x), x)
        rows, fps, ok = _slot_gather(axis, raw, slot)

        def local(rows):
            xs = jax.vmap(lambda r: _unpack(r[None, :nbytes], shape, dtype)[1])(rows)
            outs = jax.vmap(body, axis_name=axis)(xs)
            return outs[jax.lax.axis_index(axis)]

        return fps, jax.lax.cond(ok, local, _skip(body, x), rows)

    spec = PartitionSpec(axis)
    mapped = jax.shard_map(fused, mesh=process_mesh(group), in_specs=spec,
                           out_specs=(spec, spec), check_vma=False)
    compiled = jax.jit(mapped).lower(_arg(group, (nbytes,), np.uint8)).compile()
    group.extra.setdefault("programs", {})[full_key] = compiled
    stats(group)["compiles"] += 1
    return compiled


def _as_real(x, dtype):
    """A complex array as real ``[..., 2]`` (real, imaginary) of the component dtype."""
    if isinstance(x, jax.Array):
        x = x.astype(dtype)
        return jax.numpy.stack([jax.numpy.real(x), jax.numpy.imag(x)], -1)
    x = np.asarray(x, dtype)
    return np.stack([x.real, x.imag], -1)


def _as_complex(out, dtype, as_jax: bool):
    if as_jax:
        return jax.lax.complex(out[..., 0], out[..., 1]).astype(dtype)
    out = np.asarray(out)
    return (out[..., 0] + 1j * out[..., 1]).astype(dtype)


def run(group: ProcessGroup, what: str, key: tuple, build: Callable[[], Callable],
        x: Any, shape: tuple, dtype, fp: np.ndarray | None, as_jax: bool):
    """Run the program on this member's ``x``; with ``fp`` (and checks on), checked.

    Returns this process's result with the member axis dropped (numpy or jax.Array).
    64-bit dtypes (torch's default ``int64``) keep their width even when JAX's x64 mode
    is off. Complex arrays travel as real ``[..., 2]`` pairs (XLA's CPU collectives
    cannot bitcast complex numbers); every eager program works element-wise or on
    leading axes, so the pairs reduce and move like the complex values (SUM, AVG).

    Raises:
      CollectiveMismatchError: the members' fingerprints differ (on every member).
      PeerFailedError: a member died (named).
    """
    if np.dtype(dtype).kind == "c":
        with x64(dtype):
            real = _as_real(x, dtype)
            out = run(group, what, key, build, real, (*shape, 2), real.dtype, fp, as_jax)
            return _as_complex(out, dtype, as_jax)
    seq = None if fp is None else int(fp[1])
    if seq is not None:
        note(group, seq, what)
    with x64(dtype):
        small = np.dtype(dtype).itemsize * math.prod(shape) <= FUSE_LIMIT
        host = not isinstance(x, jax.Array) or local_device(group).platform == "cpu"
        if fp is not None and small and host and (
                fpr.debug_enabled() or _one_trip(group, key, build, shape, dtype)):
            # One trip with the check off too: on XLA:CPU one all-gather of a small
            # slot costs about half a small all-reduce (0.23 vs 0.46 ms on 2 processes),
            # and the fingerprints it carries are compared for free.
            # (a jax array on CPU reads as numpy without a copy)
            fn, staged, fp_row, data_row = _packed_plan(group, key, build, shape, dtype)
            stats(group)["checked"] += 1
            if staged is not None:
                fp_row[:] = fp
                np.copyto(data_row, np.asarray(x).reshape(shape), casting="unsafe")
            else:
                packed = _pack(fp, np.asarray(x, dtype=dtype))
                staged = to_global(group, packed, packed.shape, np.uint8)
            fps, block = execute(group, what, fn, staged, seq)
            fpr.check(np.asarray(fps)[0].reshape(group.size(), fpr.FP_LEN), group.ranks,
                      group.name)
            return from_block(block, as_jax)
        data = to_global(group, x, shape, dtype)
        if fp is None or not fpr.debug_enabled():
            fn = program(group, key, build, shape, dtype)
            block = execute(group, what, fn, data, seq)
            return from_block(block, as_jax)
        if not small:
            # large arrays: a separate fingerprint program is cheaper than lax.cond's
            # copies of the operand; the collective then runs only if it passed
            fingerprint_check(group, what, fp)
            fn = program(group, key, build, shape, dtype)
            return from_block(execute(group, what, fn, data, seq), as_jax)
        fn = checked_program(group, key, build, shape, dtype)
        stats(group)["checked"] += 1
        fps, block = execute(group, what, fn, (to_global(group, fp, (fpr.FP_LEN,),
                                                         np.int32), data), seq)
        fpr.check(np.asarray(fps)[0].reshape(group.size(), fpr.FP_LEN), group.ranks,
                  group.name)
        return from_block(block, as_jax)
