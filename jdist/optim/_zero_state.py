"""ZeRO state <-> the unsharded optimizer's state (host numpy, for state dicts).

The sharded state has the structure of ``tx.init(params)``; each rank >= 1 leaf of full
shape ``S`` is stored flat as ``N * ceil(size(S) / N)`` elements, data first, padding
last (see :mod:`jdist.optim._zero`). These two functions convert a whole state tree;
they only need ``ref``, the abstract unsharded state (``jax.eval_shape(tx.init, ...)``).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey, keystr

__all__ = ["full_state", "full_state_like", "resize_leaf", "sharded_state"]


def full_state(ref, host_leaves: list):
    """The unsharded state (``ref``'s structure) from the stored leaves, in order."""
    refs = jax.tree.leaves(ref)
    if len(refs) != len(host_leaves):
        raise ValueError(f"the state has {len(host_leaves)} arrays but tx.init(params) has "
                         f"{len(refs)}; pass this optimizer's own state")
    out = []
    for r, x in zip(refs, host_leaves, strict=True):
        size = math.prod(r.shape)
        if (np.ndim(x) != (1 if r.shape else 0)) or (r.shape and x.shape[0] < size):
            raise ValueError(f"a state array of shape {np.shape(x)} does not hold a "
                             f"sharded {r.shape} value; pass this optimizer's own state")
        out.append(np.asarray(x).reshape(-1)[:size].reshape(r.shape) if r.shape
                   else _host(x))
    return jax.tree.unflatten(jax.tree.structure(ref), out)


def _host(x, dtype=None):
    """numpy for numbers; PRNG key arrays (``add_noise``'s state) stay JAX arrays."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        return x
    return np.asarray(x, dtype)


def _name(key) -> str | None:
    if isinstance(key, GetAttrKey):
        return None if key.name == "value" else key.name  # nnx Variables' payload
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _norm(path) -> tuple:
    return tuple(n for n in map(_name, path) if n is not None)


def sharded_state(ref, tree, num_replicas: int):
    """``tree`` (an unsharded state, any container) as ``ref``-structured flat shards.

    Each leaf of ``ref`` takes the leaf of ``tree`` whose path ends with its path
    (container types and nnx ``.value`` ignored), so the state of a plain optax
    optimizer, of a plain ``nnx.Optimizer`` (``opt_state`` or ``nnx.state(opt)``) or of
    a consolidated ZeRO all load.
    """
    given = [(_norm(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    out = []
    for path, r in jax.tree_util.tree_flatten_with_path(ref)[0]:
        want = _norm(path)
        hits = [x for p, x in given if p[len(p) - len(want):] == want and len(p) >= len(want)]
        if len(hits) != 1 or tuple(np.shape(hits[0])) != tuple(r.shape):
            what = "is missing" if not hits else (
                f"is ambiguous ({len(hits)} entries end with it)" if len(hits) > 1 else
                f"has shape {np.shape(hits[0])}")
            raise ValueError(
                f"state_dict entry {keystr(path)} {what}; expected an array of shape "
                f"{r.shape} (the state of tx.init(params) for these parameters); was it "
                "saved from the same transformation and parameters?")
        x = _host(hits[0], r.dtype)
        if r.shape:
            n = num_replicas * max(1, -(-x.size // num_replicas))
            x = np.pad(x.reshape(-1), (0, n - x.size))
        out.append(x)
    return jax.tree.unflatten(jax.tree.structure(ref), out)


def full_state_like(ref, inner, num_replicas: int):
    """``ref`` (abstract full state) with the structure of ``inner``, after checking
    that ``inner`` holds ``ref`` sharded over ``num_replicas`` (for tracing)."""
    refs, got = jax.tree.leaves(ref), jax.tree.leaves(inner)
    if len(refs) != len(got) or any(
            np.shape(x) != ((max(1, -(-math.prod(r.shape) // num_replicas)),)
                            if r.shape else ())
            for r, x in zip(refs, got, strict=True)):
        raise ValueError(
            "the state passed to ZeroRedundancyOptimizer.update does not match "
            f"tx.init(params) sharded over {num_replicas} replicas: "
            f"{[np.shape(x) for x in got]}; pass the state from this optimizer's init "
            "(or load_state_dict)")
    return jax.tree.unflatten(jax.tree.structure(inner), refs)


def resize_leaf(saved, length: int) -> np.ndarray:
    """A stored flat state leaf (``(N * L,)``, data first) re-split for another
    replica count: ``length`` elements (for checkpoint restores on another world size).

    Exact because the data come first and the padding is zero (ZeRO zeroes it at
    every init and update); refuses, naming the fix, a leaf whose cut-off tail holds
    non-zero values.
    """
    saved = np.asarray(saved)
    keep = min(saved.shape[0], int(length))
    if saved.ndim != 1 or np.any(saved[keep:] != 0):
        raise ValueError(
            f"cannot re-split a ZeRO state leaf of shape {saved.shape} into {length} "
            "elements: it is not a flat shard whose tail past the data is zero padding; "
            "restore on the saving world size")
    out = np.zeros((int(length),), saved.dtype)
    out[:keep] = saved[:keep]
    return out
