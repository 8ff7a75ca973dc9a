"""ReduceOp: torch's reduction operators, and which dtypes each accepts."""

from __future__ import annotations

import enum

import numpy as np

from jdist.errors import UnsupportedOpError

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


_COMPLEX_OK = (ReduceOp.SUM, ReduceOp.AVG)


def check_op_dtype(op: ReduceOp, dtype, what: str = "all_reduce") -> None:
    """Raise if ``op`` cannot reduce arrays of ``dtype`` in collective ``what``.

    Raises :class:`jdist.errors.UnsupportedOpError` (a ``TypeError``, ``ValueError`` and
    ``RuntimeError``): bitwise ops need integer or bool arrays; AVG needs a non-bool
    dtype; complex arrays take only SUM and AVG (torch's "all_reduce does not support
    ... on complex tensors": MAX/MIN have no order on complex numbers, and torch's gloo
    does not multiply them).
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(
            f"op must be a jdist.ReduceOp (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR), "
            f"got {op!r}"
        )
    dt = np.dtype(dtype)
    if dt.kind == "c" and op not in _COMPLEX_OK:
        raise UnsupportedOpError(
            f"{what} does not support {op!r} on complex tensors (dtype {dt.name}); use "
            f"ReduceOp.SUM or AVG, or reduce the real and imaginary parts separately"
        )
    if op in _BITWISE and not (np.issubdtype(dt, np.integer) or dt == np.bool_):
        raise UnsupportedOpError(
            f"Cannot use {op!r} with non-integral dtype: it needs an integer or bool array, "
            f"got dtype {dt.name}; cast the array first or use SUM/MIN/MAX"
        )
    if op is ReduceOp.AVG and dt == np.bool_:
        raise UnsupportedOpError("ReduceOp.AVG cannot reduce a bool array; cast it to a number "
                                 "first")
