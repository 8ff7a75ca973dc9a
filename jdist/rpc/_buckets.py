"""Shape buckets: the protocol a module opts into so its variable-size calls compile once
per bucket instead of once per size.

A module that wants it defines ``bucket_call(self, *args)`` and returns either None (this
call is not padded) or ``(padded_args, rows)``:

- ``padded_args`` has one entry per argument; an array argument may grow, only at the
  end of its axes (same dtype and rank), anything else is returned unchanged;
- ``rows``: the module's output computed on ``padded_args`` equals, in its first
  ``rows`` entries along axis 0 of every output array, the output on the original
  arguments (the padding must not change those entries or their gradients).

jdist then compiles the padded call (a ``RemoteModule`` forward, with its VJP under
distributed autograd), cuts every output back to ``rows``, pads output cotangents with
zeros and cuts argument cotangents back to the original shapes: values and gradients
are exactly the unpadded ones. ``next_bucket`` is the usual size rule. Nothing here
knows any layer: a bag-of-embeddings layer is one module that opts in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["Padded", "next_bucket", "padded_call"]


def next_bucket(n: int, minimum: int = 64) -> int:
    """The padded size for ``n`` items: the next power of two, at least ``minimum``."""
    return max(int(minimum), 1 << max(0, int(n) - 1).bit_length())


class Padded(NamedTuple):
    """A call padded by its module's ``bucket_call``: the padded arguments, the real
    output rows and the original argument shapes (None for non-arrays)."""

    args: tuple
    rows: int
    shapes: tuple

    def cut_output(self, out: Any) -> Any:
        """Every output array back to its first ``rows`` entries (numpy)."""
        import jax

        return jax.tree_util.tree_map(lambda o: np.asarray(o)[:self.rows], out)

    def pad_cotangent(self, ct: np.ndarray, padded_shape: tuple) -> np.ndarray:
        """An output cotangent of the real rows, zero-padded to the padded output."""
        big = np.zeros(padded_shape, ct.dtype)
        big[tuple(slice(0, s) for s in ct.shape)] = ct
        return big

    def cut_argument(self, position: int, ct: Any) -> np.ndarray:
        """An argument's cotangent back to the argument's original shape."""
        shape = self.shapes[position]
        return np.asarray(ct)[tuple(slice(0, s) for s in shape)]


def _check(module: Any, args: tuple, answer: Any) -> Padded:
    where = f"{type(module).__qualname__}.bucket_call"
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise TypeError(f"{where} must return None or (padded_args, rows), got {answer!r}")
    padded, rows = answer
    if not isinstance(padded, tuple) or len(padded) != len(args):
        raise TypeError(f"{where} must return one padded argument per argument "
                        f"({len(args)}), got {padded!r}")
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 0:
        raise TypeError(f"{where} must return rows as an int >= 0, got {rows!r}")
    shapes = []
    for i, (a, p) in enumerate(zip(args, padded, strict=True)):
        if not isinstance(a, np.ndarray):
            shapes.append(None)
            continue
        ok = (isinstance(p, np.ndarray) and p.dtype == a.dtype and p.ndim == a.ndim
              and all(q >= s for q, s in zip(p.shape, a.shape, strict=True)))
        if not ok:
            raise ValueError(f"{where}: argument {i} of shape {a.shape} {a.dtype} must "
                             f"be padded only at the end of its axes (same dtype and "
                             f"rank), got {getattr(p, 'shape', p)!r} "
                             f"{getattr(p, 'dtype', type(p).__name__)}")
        shapes.append(a.shape)
    return Padded(padded, int(rows), tuple(shapes))


def padded_call(module: Any, args: tuple) -> Padded | None:
    """``module``'s padded call for positional ``args``, or None when the module does
    not opt in or declines this call.

    Raises:
      TypeError / ValueError: ``bucket_call`` broke the protocol (named in the text).
    """
    method = getattr(module, "bucket_call", None)
    if method is None or not callable(method):
        return None
    answer = method(*args)
    return None if answer is None else _check(module, args, answer)
