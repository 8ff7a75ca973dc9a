"""PowerSGD comm hooks (Vogels et al., 2019) with torch's state, defaults and maths.

``PowerSGDState`` is torch's ``PowerSGDState`` as a JAX pytree: the hyperparameters are
static (pytree metadata) and the changing parts are arrays that DDP threads through the
jitted step:

- ``iter``: the step counter (int32). It grows by one when the bucket with
  ``is_last=True`` has been reduced, exactly as torch's ``maybe_increase_iter``; the
  hooks never infer the step from bucket order.
- ``error_dict[bucket_index]``: this replica's error-feedback memory (flat, bucket
  length; differs between replicas).
- ``q_memory_dict[bucket_index]``: the warm-start Q factors (flat; equal on all
  replicas after each step).

Memories need static shapes, so they are made per bucket by
``init_hook_state(hook, state, buckets)`` (or lazily, the first time the hook sees a
bucket index: the jitted step then returns a state with more leaves once, and is
traced a second time). Creation is deterministic (zeros, and Q drawn from
``random_seed`` and the bucket index), so both routes give the same values.

Differences from torch, on purpose:

- a column of zeros in Gram-Schmidt stays zero (torch divides by a zero norm and
  fills the bucket with NaNs when ``orthogonalization_epsilon=0``);
- collectives on empty buffers are skipped (torch launches an all-reduce of an empty
  tensor when a bucket has no uncompressed tensors): a bucket with both matrices and
  vectors runs torch's 3 all-reduces (rest, P, Q); ``batched_powerSGD_hook`` runs 2;
- ``compression_stats()`` reports one step (torch accumulates counts over steps; the
  ratio is the same);
- random Q factors come from ``jax.random`` (torch uses numpy/torch generators), so
  values differ from torch's for the same seed; the maths and the criterion are equal,
  on torch's matrices (:func:`torch_axes`): with the same initial Q (set
  ``q_memory_dict``), results are torch's (``tests/differential/test_ddp_diff.py``
  injects torch's Q factors).
- ``batch_tensors_with_same_shape`` is accepted and has no effect on results (XLA
  fuses the small matmuls itself).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.ddp.hooks._base import GradBucket
from jdist.ddp.hooks._default import reduce_axis
from jdist.errors import BucketLayoutError

__all__ = [
    "PowerSGDState",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    "should_compress",
]

_META = (
    "process_group", "matrix_approximation_rank", "start_powerSGD_iter",
    "min_compression_rate", "use_error_feedback", "warm_start", "orthogonalization_epsilon",
    "random_seed", "compression_stats_logging_frequency", "batch_tensors_with_same_shape",
    "layout",
)
_DATA = ("iter", "error_dict", "q_memory_dict")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_DATA),
                   meta_fields=list(_META))
@dataclasses.dataclass(frozen=True, eq=False)
class PowerSGDState:
    """Hyperparameters and memories of :func:`powerSGD_hook` (torch's fields and defaults).

    Args:
      process_group: ``None`` or the DDP's ProcessGroup (torch's first argument).
      matrix_approximation_rank: rank ``r`` of the low-rank factors.
      start_powerSGD_iter: plain mean all-reduce while ``iter < start_powerSGD_iter``.
      min_compression_rate: compress a ``n x m`` matrix only if
        ``(n + m) * r * min_compression_rate < n * m``.
      use_error_feedback: add the previous step's compression error before compressing.
      warm_start: reuse the last step's Q instead of a fresh random one.
      orthogonalization_epsilon: added to column norms in Gram-Schmidt.
      random_seed: seed of the random Q factors.
      compression_stats_logging_frequency: kept for torch parity (no logging here).
      batch_tensors_with_same_shape: kept for torch parity (no effect on results).

    Raises:
      ValueError: ``(use_error_feedback or warm_start) and start_powerSGD_iter <= 1``
        (torch's message), or a rank below 1.
    """

    process_group: Any = None
    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0
    random_seed: int = 0
    compression_stats_logging_frequency: int = 10_000
    batch_tensors_with_same_shape: bool = False
    iter: Any = dataclasses.field(default_factory=lambda: np.zeros((), np.int32))
    error_dict: dict = dataclasses.field(default_factory=dict)
    q_memory_dict: dict = dataclasses.field(default_factory=dict)
    layout: tuple = ()

    def __post_init__(self):
        if (self.use_error_feedback or self.warm_start) and self.start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
                "enabled, because PowerSGD can only be applied after the first two iterations "
                f"in DDP. (got start_powerSGD_iter={self.start_powerSGD_iter!r})"
            )
        r = self.matrix_approximation_rank
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
            raise ValueError(
                f"matrix_approximation_rank must be an int >= 1, got {r!r}; pass e.g. "
                f"PowerSGDState(matrix_approximation_rank=1)"
            )

    def replace(self, **changes) -> PowerSGDState:
        """A copy with some fields changed (the state is immutable)."""
        return dataclasses.replace(self, **changes)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, numel_before, numel_after)`` for one compressed step over known buckets.

        Counts come from the buckets this state has memories for (torch sums them over
        the steps since PowerSGD started; the rate is the same).
        """
        before = sum(b for _, b, _ in self.layout)
        after = sum(a for _, _, a in self.layout)
        return (before / after if after else 0, before, after)


def should_compress(num_rows, num_cols, matrix_approximation_rank, min_compression_rate):
    """torch's criterion: ``(compress?, uncompressed numel, compressed numel)``."""
    uncompressed = num_rows * num_cols
    compressed = (num_rows + num_cols) * matrix_approximation_rank
    return compressed * min_compression_rate < uncompressed, uncompressed, compressed


def _check_state(state, name):
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"{name} expects a PowerSGDState as its state, got {type(state).__name__}; "
            f"register it with ddp.register_comm_hook(PowerSGDState(...), {name})"
        )


def torch_axes(path: str, ndim: int) -> tuple[int, ...]:
    """The axis order that lays a parameter out as torch's equivalent (identity for all
    but Flax kernels).

    A Flax ``kernel`` keeps its output features last: ``(in, out)`` for a Dense layer,
    ``(kh, kw, in, out)`` for a Conv; torch's weights lead with them: ``(out, in)``,
    ``(out, in, kh, kw)``. PowerSGD compresses ``view(shape[0], -1)`` of torch's weight,
    so a kernel is first brought to torch's order: rows are output features, as in
    torch (for a Conv kernel ``shape[0]`` would otherwise be the kernel height), and the
    matrix is torch's exactly, so the same Q factors give the same result.
    """
    if ndim >= 2 and path.rsplit("/", 1)[-1] == "kernel":
        return (ndim - 1, ndim - 2, *range(ndim - 2))
    return tuple(range(ndim))


def _plan(bucket: GradBucket, state: PowerSGDState):
    """Per gradient: (offset, size, n, m, r, compress?) with torch's ``view(shape[0], -1)``
    of the gradient in torch's layout (:func:`torch_axes`)."""
    plan = []
    for off, g, path in zip(bucket.offsets(), bucket.gradients, bucket.parameters,
                            strict=True):
        size = int(np.prod(g.shape, dtype=np.int64))
        axes = torch_axes(path, g.ndim)
        n = int(g.shape[axes[0]]) if g.ndim >= 1 else 1
        m = size // n if n else 0
        r = min(n, m, state.matrix_approximation_rank)
        ok = should_compress(n, m, r, state.min_compression_rate)[0] and size > 0
        plan.append((off, size, n, m, r, bool(ok)))
    return plan


def _to_matrix(flat, g, path, n, m):
    """A gradient's slice of the bucket as torch's ``(n, m)`` matrix."""
    axes = torch_axes(path, g.ndim)
    return jnp.transpose(flat.reshape(g.shape), axes).reshape(n, m)


def _from_matrix(mat, g, path):
    """:func:`_to_matrix` undone: the flat slice in the bucket's layout."""
    axes = torch_axes(path, g.ndim)
    moved = mat.reshape(tuple(g.shape[a] for a in axes))
    return jnp.transpose(moved, np.argsort(axes)).reshape(-1)


def _orthogonalize(mat, epsilon):
    """Orthonormal columns (torch: Gram-Schmidt for rank <= 2 or half dtypes, else QR)."""
    rank = mat.shape[1]
    if rank > 2 and mat.dtype not in (jnp.float16, jnp.bfloat16):
        return jnp.linalg.qr(mat, mode="reduced")[0]
    cols = []
    for i in range(rank):
        col = mat[:, i]
        for prev in cols:
            col = col - jnp.sum(prev * col) * prev
        norm = jnp.linalg.norm(col)
        if epsilon == 0:
            col = jnp.where(norm > 0, col / jnp.where(norm > 0, norm, 1), 0)
        else:
            col = col / (norm + epsilon)
        cols.append(col)
    return jnp.stack(cols, axis=1)


def _q_init(state, index, size, dtype, step=None):
    key = jax.random.fold_in(jax.random.key(state.random_seed), index)
    if step is not None:
        key = jax.random.fold_in(key, step)
    return jax.random.normal(key, (size,), dtype)


def _add_memories(state, bucket, err_len, q_len, before, after):
    """Create (or check) the memories of ``bucket`` (static shapes, deterministic values)."""
    idx, dtype = bucket.index, bucket.buffer.dtype
    errs, qs = dict(state.error_dict), dict(state.q_memory_dict)
    for name, mem, want in (("error", errs, err_len), ("Q", qs, q_len)):
        if idx in mem and tuple(mem[idx].shape) != (want,):
            raise BucketLayoutError(
                f"PowerSGD {name} memory of bucket {idx} has shape {tuple(mem[idx].shape)}, "
                f"but the bucket now needs ({want},); the bucket layout changed after the "
                f"hook state was made: build a fresh PowerSGDState for the new layout"
            )
    if state.use_error_feedback and idx not in errs:
        errs[idx] = jnp.zeros((err_len,), dtype)
    if state.warm_start and idx not in qs and q_len:  # no empty leaves (shardings)
        qs[idx] = _q_init(state, idx, q_len, dtype)
    layout = tuple(e for e in state.layout if e[0] != idx) + ((idx, before, after),)
    return state.replace(error_dict=errs, q_memory_dict=qs, layout=tuple(sorted(layout)))


def _init_plain(state: PowerSGDState, bucket: GradBucket) -> PowerSGDState:
    plan = _plan(bucket, state)
    q_len = sum(m * r for _, _, _, m, r, ok in plan if ok)
    before = sum(s for _, s, *_ in plan)
    after = sum((n + m) * r if ok else s for _, s, n, m, r, ok in plan)
    return _add_memories(state, bucket, int(bucket.buffer.shape[0]), q_len, before, after)


def _batched_dims(state, bucket):
    total = int(bucket.buffer.shape[0])
    side = math.ceil(math.sqrt(total))
    return total, side, max(1, min(side, state.matrix_approximation_rank))


def _init_batched(state: PowerSGDState, bucket: GradBucket) -> PowerSGDState:
    total, side, r = _batched_dims(state, bucket)
    return _add_memories(state, bucket, side * side, side * r, total, 2 * side * r)


def _mean_allreduce(buf, axis, world):
    return jax.lax.psum(buf / jnp.asarray(world, buf.dtype), axis)


def _varying(x, axis):
    """``x`` typed as per-replica over ``axis`` (memories are; ``lax.cond`` needs one type)."""
    if x is None:
        return None
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    vma = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
    names = axis if isinstance(axis, tuple) else (axis,)
    missing = tuple(a for a in names if a not in vma)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _with_warmup(state, bucket, axis, compress):
    """torch's ``iter < start_powerSGD_iter`` switch (a ``lax.cond``), then ``iter += is_last``."""
    idx = bucket.index
    err = state.error_dict.get(idx)
    q = state.q_memory_dict.get(idx)

    def warm(_):
        out = _mean_allreduce(bucket.buffer, axis, bucket.num_replicas)
        return out, _varying(err, axis), _varying(q, axis)

    def comp(_):
        out, e, qq = compress(None)
        return out, _varying(e, axis), _varying(qq, axis)

    if state.start_powerSGD_iter <= 0:
        out, err2, q2 = comp(None)
    else:
        out, err2, q2 = jax.lax.cond(state.iter < state.start_powerSGD_iter, warm, comp, None)
    errs, qs = dict(state.error_dict), dict(state.q_memory_dict)
    if err is not None:
        errs[idx] = err2
    if q is not None:
        qs[idx] = q2
    step = jnp.asarray(state.iter, jnp.int32) + (1 if bucket.is_last else 0)
    return out, state.replace(iter=step, error_dict=errs, q_memory_dict=qs)


def _psum_nonempty(x, axis):
    return jax.lax.psum(x, axis) if x.size else x


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket):
    """PowerSGD: each gradient as a ``(shape[0], -1)`` matrix, compressed to rank ``r``.

    Matrices that pass torch's criterion are approximated as ``P Q^T`` (P = M Q summed
    and orthogonalized, Q = M^T P averaged); the rest (vectors, small matrices) is mean
    all-reduced uncompressed: 3 all-reduces per bucket (rest, P, Q). With error
    feedback the previous error is added first and ``input - result`` is kept.

    Args:
      state: a :class:`PowerSGDState` (returned updated, never mutated).
      bucket: the bucket to reduce.

    Returns:
      ``(reduced_buffer, new_state)``.
    """
    _check_state(state, "powerSGD_hook")
    axis = reduce_axis(state.process_group, bucket, "powerSGD_hook")
    if bucket.index not in state.error_dict and bucket.index not in state.q_memory_dict:
        state = _init_plain(state, bucket)
    plan, idx, world = _plan(bucket, state), bucket.index, bucket.num_replicas
    eps = state.orthogonalization_epsilon

    def compress(_):
        x = bucket.buffer
        if state.use_error_feedback:
            x = x + state.error_dict[idx]
        dtype = x.dtype
        grads = list(zip(bucket.gradients, bucket.parameters, strict=True))
        mats = [_to_matrix(x[o:o + s], *grads[i], n, m)
                for i, (o, s, n, m, r, ok) in enumerate(plan) if ok]
        ranks = [(m, r) for _, _, _, m, r, ok in plan if ok]
        rest = [x[o:o + s] for o, s, *_, ok in plan if not ok]
        rest = jnp.concatenate(rest) if rest else jnp.zeros((0,), dtype)
        q_len = sum(m * r for m, r in ranks)
        if state.warm_start:
            q_flat = state.q_memory_dict.get(idx, jnp.zeros((0,), dtype))
        else:
            q_flat = _q_init(state, idx, q_len, dtype, step=state.iter)
        qs, pos = [], 0
        for m, r in ranks:
            qs.append(_orthogonalize(q_flat[pos:pos + m * r].reshape(m, r), eps))
            pos += m * r
        ps = [mat @ q for mat, q in zip(mats, qs, strict=True)]
        rest = _psum_nonempty(rest, axis) / jnp.asarray(world, dtype)
        p_flat = _psum_nonempty(_concat(ps, dtype), axis)
        ps = [_orthogonalize(p, eps) for p in _split(p_flat, [p.shape for p in ps])]
        qs = [mat.T @ p for mat, p in zip(mats, ps, strict=True)]
        q_flat = _psum_nonempty(_concat(qs, dtype), axis) / jnp.asarray(world, dtype)
        qs = _split(q_flat, [q.shape for q in qs])
        approx = iter([p @ q.T for p, q in zip(ps, qs, strict=True)])
        pieces, rpos = [], 0
        for i, (_, s, _, _, _, ok) in enumerate(plan):
            if ok:
                pieces.append(_from_matrix(next(approx), *grads[i]))
            else:
                pieces.append(rest[rpos:rpos + s])
                rpos += s
        out = _concat(pieces, dtype)
        err = x - out if state.use_error_feedback else None
        return out, err, (q_flat if idx in state.q_memory_dict else None)

    return _with_warmup(state, bucket, axis, compress)


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradBucket):
    """Simplified PowerSGD: the whole bucket as one zero-padded square matrix.

    The side is ``ceil(sqrt(numel))``; 2 all-reduces per bucket (P, Q). Much less
    accurate than :func:`powerSGD_hook` unless the rank is 1 (torch's warning).
    """
    _check_state(state, "batched_powerSGD_hook")
    axis = reduce_axis(state.process_group, bucket, "batched_powerSGD_hook")
    if bucket.index not in state.error_dict and bucket.index not in state.q_memory_dict:
        state = _init_batched(state, bucket)
    total, side, r = _batched_dims(state, bucket)
    idx, world, eps = bucket.index, bucket.num_replicas, state.orthogonalization_epsilon

    def compress(_):
        dtype = bucket.buffer.dtype
        x = jnp.concatenate([bucket.buffer, jnp.zeros((side * side - total,), dtype)])
        if state.use_error_feedback:
            x = x + state.error_dict[idx]
        mat = x.reshape(side, side)
        if state.warm_start:
            q = state.q_memory_dict[idx].reshape(side, r)
        else:
            q = _q_init(state, idx, side * r, dtype, step=state.iter).reshape(side, r)
        p = jax.lax.psum(mat @ _orthogonalize(q, eps), axis)
        p = _orthogonalize(p, eps)
        q = jax.lax.psum(mat.T @ p, axis) / jnp.asarray(world, dtype)
        out = (p @ q.T).reshape(-1)
        err = x - out if state.use_error_feedback else None
        return out[:total], err, (q.reshape(-1) if state.warm_start else None)

    return _with_warmup(state, bucket, axis, compress)


def _concat(parts, dtype):
    return jnp.concatenate([p.reshape(-1) for p in parts]) if parts else jnp.zeros((0,), dtype)


def _split(flat, shapes):
    out, pos = [], 0
    for shp in shapes:
        size = int(np.prod(shp))
        out.append(flat[pos:pos + size].reshape(shp))
        pos += size
    return out


powerSGD_hook.init_state = _init_plain
batched_powerSGD_hook.init_state = _init_batched
