"""ReduceOp: torch's reduction operators, and which dtypes each accepts."""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["ReduceOp", "check_op_dtype"]


class ReduceOp(enum.Enum):
    """Reduction operators of ``torch.distributed.ReduceOp``.

    ``PREMUL_SUM`` is NCCL-only in torch and is not offered.
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def check_op_dtype(op: ReduceOp, dtype) -> None:
    """Raise ``TypeError`` if ``op`` cannot reduce arrays of ``dtype``.

    Bitwise ops need integer or bool arrays; AVG needs a non-bool dtype.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(
            f"op must be a jdist.ReduceOp (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR), "
            f"got {op!r}"
        )
    dt = np.dtype(dtype)
    if op in _BITWISE and not (np.issubdtype(dt, np.integer) or dt == np.bool_):
        raise TypeError(
            f"{op!r} needs an integer or bool array, got dtype {dt.name}; "
            f"cast the array first or use SUM/MIN/MAX"
        )
    if op is ReduceOp.AVG and dt == np.bool_:
        raise TypeError("ReduceOp.AVG cannot reduce a bool array; cast it to a number first")
