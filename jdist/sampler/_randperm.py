"""``torch.randperm`` on the CPU generator, bit for bit, in vectorized numpy.

torch (``aten/src/ATen/native/TensorFactories.cpp``, ``randperm_cpu``) seeds MT19937 with
the low 32 bits of the seed (``init_genrand``) and, for ``n < 2**32 // 20``, runs a
forward Fisher-Yates pass::

    a = [0, 1, ..., n-1]
    for i in range(n - 1):
        j = i + rand32() % (n - i)
        a[i], a[j] = a[j], a[i]

numpy's ``MT19937`` with legacy seeding yields the same 32-bit stream, so the draws are
cheap; the swaps are the hard part, because each one depends on all earlier ones. A
Python loop over them is 25-50x slower than torch.

How the swaps are vectorized (exactly). Steps run in chunks of ``_CHUNK`` consecutive
steps ``[s, e)``; ``a`` holds the array state before the chunk. For a step ``k`` of the
chunk with target ``j_k``:

* position ``k`` is final after step ``k``, and its value is whatever sits at ``j_k``
  just before step ``k``: the value written there by the latest earlier chunk step with
  the same target (its *predecessor*), or ``a[j_k]`` if there is none;
* the value that step ``k`` writes to ``j_k`` is ``V(k)``, the value at position ``k``
  just before step ``k``: ``V(k) = V(p)`` where ``p`` is the latest earlier chunk step
  that targeted ``k`` (``p < k``; a self-swap ``j_k = k`` changes nothing), or ``a[k]``.

Grouping the chunk's steps by target (a stable two-pass 16-bit radix sort, which numpy
runs in linear time) gives every predecessor at once; ``V`` is a forest of pointers to
smaller indices, resolved by pointer doubling. The chunk's positions ``[s, e)`` are then
final, and each target beyond the chunk receives ``V`` of its last writer. Chunks keep
the work in cache; the only scattered memory accesses are one read and one write per
step, as in torch's own loop.

For ``n >= 2**32 // 20`` torch switches to an "inside-out" shuffle over 64-bit draws
(``z = random64() % (i + 1); a[i] = a[z]; a[z] = i`` for ``i`` in ``0 .. n-1``, where
``random64`` joins two 32-bit draws, the first as the high half). It is vectorized the
same way: chunks of steps, grouped by ``z``, each reading the latest earlier write to
its ``z`` or, failing that, the value moved in there (a pointer chain).
"""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["randperm", "TORCH_SWAP_LIMIT", "SEED_MIN", "SEED_MAX"]

#: torch uses the swap algorithm for ``n`` below this size (``UINT32_MAX // 20``).
TORCH_SWAP_LIMIT = (2**32 - 1) // 20
#: the seed range ``torch.Generator.manual_seed`` accepts (negatives wrap modulo 2**64).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1

_CHUNK_BITS = 14
_CHUNK = 1 << _CHUNK_BITS


def _check_n(n) -> int:
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(
            f"randperm: n must be an int, got {n!r} of type {type(n).__name__}"
        ) from None
    if n < 0:
        raise ValueError(f"randperm: n must be non-negative, got {n}")
    return n


def check_seed(seed) -> int:
    """``seed`` as an int, if ``torch.Generator.manual_seed`` accepts it.

    Raises:
      TypeError: ``seed`` is not an int.
      ValueError: ``seed`` is outside ``[-2**63, 2**64 - 1]`` (torch raises too).
    """
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(
            f"seed must be an int, got {seed!r} of type {type(seed).__name__}"
        ) from None
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(
            f"seed {seed} is outside the range torch.Generator.manual_seed accepts, "
            f"[{SEED_MIN}, {SEED_MAX}]; for DistributedSampler this is seed + epoch, so "
            "pick a smaller seed or epoch"
        )
    return seed


def _draws(seed: int) -> np.random.MT19937:
    """The MT19937 stream torch's CPU generator produces after ``manual_seed(seed)``.

    torch seeds with ``init_genrand(seed & 0xffffffff)``; the same key is set here
    through numpy's public ``state`` (``pos = 624`` makes the first draw twist).
    """
    key = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        prev = key[-1]
        key.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    bit_gen = np.random.MT19937(0)
    bit_gen.state = {
        "bit_generator": "MT19937",
        "state": {"key": np.array(key, dtype=np.uint32), "pos": 624},
    }
    return bit_gen


def _group_by_target(off: np.ndarray, span: int) -> np.ndarray:
    """Step indices sorted by target (``0 <= off < span``), ties in step order.

    A stable LSD radix sort over 16-bit digits (numpy sorts uint16 by counting).
    """
    order = np.argsort((off & 0xFFFF).astype(np.uint16), kind="stable")
    shift = 16
    while span > (1 << shift):
        digit = ((off >> shift) & 0xFFFF).astype(np.uint16)[order]
        order = order[np.argsort(digit, kind="stable")]
        shift += 16
    return order


def _resolve_roots(ptr: np.ndarray) -> np.ndarray:
    """Follow ``ptr`` (``ptr[i] <= i``, roots point at themselves) to the roots."""
    while True:
        nxt = ptr[ptr]
        if np.array_equal(nxt, ptr):
            return ptr
        ptr = nxt


def _apply_chunk(a: np.ndarray, s: int, off: np.ndarray, steps: np.ndarray) -> None:
    """Apply the swaps of steps ``s .. s+C-1`` (targets ``s + off``) to ``a`` in place."""
    size = off.size
    order = _group_by_target(off, a.size - s)
    t_sorted = off[order]
    same = t_sorted[1:] == t_sorted[:-1]
    # predecessor: latest earlier step of the chunk with the same target, else -1
    pred = np.full(size, -1, np.int64)
    pred[order[1:][same]] = order[:-1][same]
    # last writer of each distinct target (its value stays there after the chunk)
    is_last = np.empty(size, bool)
    is_last[:-1] = ~same
    is_last[-1] = True
    last_target = t_sorted[is_last]
    last_step = order[is_last]
    inside = int(np.searchsorted(last_target, size))
    # V(k) = V(latest earlier step that targeted position k), else the value a[s + k]
    parent = np.full(size, -1, np.int64)
    parent[last_target[:inside]] = last_step[:inside]
    self_swap = off == steps
    parent[self_swap] = pred[self_swap]
    roots = _resolve_roots(np.where(parent < 0, steps, parent))
    values = a[s : s + size][roots]
    before = a[off + s]
    out = np.where(pred < 0, before, values[pred])
    a[last_target[inside:] + s] = values[last_step[inside:]]
    a[s : s + size] = out


def _apply_inside_out_chunk(a: np.ndarray, s: int, z: np.ndarray, steps: np.ndarray) -> None:
    """Steps ``i = s .. s+C-1`` of torch's inside-out shuffle (``a[i] = a[z_i]; a[z_i] =
    i``, with ``z_i <= i``) applied to ``a`` in place.

    Position ``z_i`` holds, just before step ``i``: ``t`` for the latest earlier chunk
    step ``t`` with ``z_t = z_i``; else, if ``z_i < s``, its value from before the chunk;
    else the value that step ``z_i`` moved in (a pointer to a smaller step).
    """
    size = z.size
    absolute = steps + s
    order = _group_by_target(z, s + size)
    z_sorted = z[order]
    same = z_sorted[1:] == z_sorted[:-1]
    pred = np.full(size, -1, np.int64)
    pred[order[1:][same]] = order[:-1][same]
    is_last = np.empty(size, bool)
    is_last[:-1] = ~same
    is_last[-1] = True
    last_z = z_sorted[is_last]
    last_step = order[is_last]
    # moved-in value of each chunk position, as a root value or a pointer to another step
    root_value = np.where(pred >= 0, pred + s, a[np.minimum(z, max(s - 1, 0))])
    self_swap = z == absolute
    root_value[self_swap] = absolute[self_swap]
    chase = (pred < 0) & ~self_swap & (z >= s)
    ptr = np.where(chase, z - s, steps)
    moved_in = root_value[_resolve_roots(ptr)]
    # final values: the last writer's index, else the moved-in value
    inside = int(np.searchsorted(last_z, s))
    final = moved_in
    final[last_z[inside:] - s] = last_step[inside:] + s
    a[last_z[:inside]] = last_step[:inside] + s
    a[s : s + size] = final


def _inside_out(n: int, seed: int, dtype) -> np.ndarray:
    """torch's permutation for ``n >= TORCH_SWAP_LIMIT`` (64-bit draws, inside-out)."""
    a = np.empty(n, dtype=dtype)
    bit_gen = _draws(seed)
    steps_all = np.arange(_CHUNK, dtype=np.int64)
    for s in range(0, n, _CHUNK):
        e = min(s + _CHUNK, n)
        raw = bit_gen.random_raw(2 * (e - s))
        draw64 = (raw[0::2] << np.uint64(32)) | raw[1::2]  # random64(): hi, then lo
        z = (draw64 % np.arange(s + 1, e + 1, dtype=np.uint64)).astype(np.int64)
        _apply_inside_out_chunk(a, s, z, steps_all[: e - s])
    return a


def randperm(n: int, seed: int, *, dtype=np.int64) -> np.ndarray:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` without torch.

    Bit-exact with torch's CPU generator for every ``seed`` torch accepts (only its low
    32 bits matter), for both of torch's algorithms: the forward swap pass below
    ``TORCH_SWAP_LIMIT`` (214748364) and the inside-out pass from there on.

    Args:
      n: length of the permutation.
      seed: the generator seed, in ``[-2**63, 2**64 - 1]`` like ``manual_seed``.
      dtype: integer dtype of the result (the values do not depend on it).

    Returns:
      A numpy array holding a permutation of ``range(n)``.

    Raises:
      ValueError: ``n`` is negative or ``seed`` is out of range.

    Examples:
      >>> randperm(10, 0).tolist()
      [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]
    """
    n = _check_n(n)
    seed = check_seed(seed)
    work_dtype = np.int32 if n < 2**31 else np.int64
    if n >= TORCH_SWAP_LIMIT:
        return _inside_out(n, seed, work_dtype).astype(dtype, copy=False)
    a = np.arange(n, dtype=work_dtype)
    if n <= 1:
        return a.astype(dtype)
    bit_gen = _draws(seed)
    steps_all = np.arange(_CHUNK, dtype=np.int64)
    last = n - 1  # number of swap steps
    for s in range(0, last, _CHUNK):
        e = min(s + _CHUNK, last)
        steps = steps_all[: e - s]
        raw = bit_gen.random_raw(e - s).astype(np.uint32)
        modulus = np.arange(n - s, n - e, -1, dtype=np.uint32)
        off = (raw % modulus).astype(np.int64)
        off += steps  # target j = s + off
        _apply_chunk(a, s, off, steps)
    return a.astype(dtype, copy=False)
