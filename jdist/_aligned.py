"""Host arrays that XLA on CPU can take without a copy (numpy only, floor 0).

XLA's CPU client aliases a host array's memory only when it starts on a 64-byte
boundary; numpy's own arrays are 16-byte aligned, so handing one to JAX costs a copy.
Used by the eager collectives' staging buffers (``jdist/collectives/_engine.py``) and
``jdist.ft``'s averaged gradients (``jdist/ft/_rules.py``).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ALIGN", "aligned_empty"]

ALIGN = 64  # bytes


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array of ``shape`` whose data starts on an ``ALIGN`` boundary."""
    dtype = np.dtype(dtype)
    nbytes = dtype.itemsize * math.prod(int(d) for d in shape)
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)
