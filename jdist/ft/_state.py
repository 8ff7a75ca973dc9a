"""A pytree's leaves as frames and back, checked against the receiver's own tree.

Healing sends a live replica's state (parameters, optimizer state, sampler position,
step) to a replica that joins. Both run the same program, so the receiver rebuilds the
values into its own tree structure; the header lists each leaf's dtype and shape and
any difference raises instead of loading a wrong state. No pickle: the header is JSON,
the leaves raw bytes. JAX PRNG key arrays travel as their key data.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from jdist.errors import FtError

__all__ = ["pack", "unpack", "to_numpy"]


def _is_key(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def to_numpy(leaf) -> np.ndarray:
    """A leaf as a contiguous numpy array (key arrays as their key data)."""
    if _is_key(leaf):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf, order="C")  # (ascontiguousarray would make 0-d 1-d)


def pack(tree) -> list[bytes | np.ndarray]:
    """``[header, leaf0, leaf1, ...]`` for :func:`unpack`."""
    leaves = jax.tree.leaves(tree)
    arrays = [to_numpy(x) for x in leaves]
    header = [[a.dtype.name, list(a.shape), _is_key(x)]
              for a, x in zip(arrays, leaves, strict=True)]
    return [json.dumps(header).encode(), *arrays]


def unpack(frames, like, who: str):
    """Rebuild ``like``'s tree with the leaves in ``frames`` (from ``who``).

    Raises:
      FtError: the number, dtype or shape of the leaves differs from ``like``'s.
    """
    leaves, treedef = jax.tree.flatten(like)
    header = json.loads(bytes(frames[0]))
    if len(header) != len(leaves) or len(frames) != len(leaves) + 1:
        raise FtError(f"the state from {who} has {len(header)} leaves, this replica's "
                      f"has {len(leaves)}: every replica must build the same model and "
                      f"optimizer")
    out = []
    for i, ((dtype, shape, is_key), mine, frame) in enumerate(
            zip(header, leaves, frames[1:], strict=True)):
        ref = to_numpy(mine)
        if (dtype, tuple(shape), is_key) != (ref.dtype.name, ref.shape, _is_key(mine)):
            kind = ("a PRNG key array " if is_key else "", "a PRNG key array "
                    if _is_key(mine) else "")
            raise FtError(f"leaf {i} of the state from {who} is {kind[0]}{dtype}{shape}, "
                          f"this replica's is {kind[1]}{ref.dtype.name}{list(ref.shape)}: "
                          f"every replica must build the same model and optimizer")
        value = np.frombuffer(frame, dtype=ref.dtype).reshape(ref.shape)
        if isinstance(mine, int | float | bool):  # a Python scalar stays one
            out.append(type(mine)(value.item()))
            continue
        if is_key:
            out.append(jax.random.wrap_key_data(value, impl=jax.random.key_impl(mine)))
        elif isinstance(mine, jax.Array):
            out.append(jax.device_put(value, mine.sharding))
        else:
            out.append(value.copy())
    return jax.tree.unflatten(treedef, out)
