"""``_fingerprint.encode`` caches each call's fixed fields (``_fixed``); a generated set
of calls checks every field against the call it came from, that different calls get
different fingerprints, and that writing into one fingerprint never changes the next."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.collectives import _fingerprint as fpr
from jdist.collectives._types import ReduceOp

DTYPES = ["bool", "int8", "int32", "int64", "uint8", "float16", "bfloat16", "float32",
          "float64", "complex64"]

calls = st.tuples(
    st.integers(0, 2**31 - 2),
    st.sampled_from(fpr.KINDS),
    st.one_of(st.none(), st.sampled_from(list(ReduceOp))),
    st.lists(st.integers(0, 5000), max_size=10).map(tuple),
    st.one_of(st.none(), st.sampled_from(DTYPES)),
    st.integers(-1, 7),
    st.integers(-1, 7),
)


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return None if name is None else np.dtype(name)


@settings(max_examples=300, deadline=None)
@given(calls)
def test_every_field_reads_back_from_the_call(call):
    seq, kind, op, shape, dtype, root, count = call
    fp = fpr.encode(seq, kind, op, shape, _dtype(dtype), root, count)
    assert fp.dtype == np.int32 and fp.shape == (fpr.FP_LEN,) and fp.flags.writeable
    assert fp[1] == seq and fpr.KINDS[fp[2]] == kind
    assert fp[3] == (-1 if op is None else list(ReduceOp).index(op))
    assert (fp[4] >= 0) == (dtype is not None)
    assert (fp[5], fp[6], fp[7]) == (root, count, len(shape))
    if len(shape) <= 8:
        assert tuple(fp[8:8 + len(shape)]) == shape
    text = fpr.describe(fp)
    assert text.startswith(f"{kind} #{seq}")
    if dtype is not None and len(shape) <= 8:
        assert f"shape={shape}" in text and f"dtype={dtype}" in text


@settings(max_examples=200, deadline=None)
@given(calls, calls)
def test_different_calls_differ_and_writes_do_not_leak(a, b):
    fa = fpr.encode(a[0], a[1], a[2], a[3], _dtype(a[4]), a[5], a[6])
    fa[:] = 0  # the caller owns its copy: the cache must not see this
    fa2 = fpr.encode(a[0], a[1], a[2], a[3], _dtype(a[4]), a[5], a[6])
    fb = fpr.encode(b[0], b[1], b[2], b[3], _dtype(b[4]), b[5], b[6])
    assert fa2[0] != 0 and fa2[2] == fpr.KINDS.index(a[1])
    same = a == b or (len(a[3]) > 8 and len(b[3]) > 8 and a[:3] == b[:3] and a[4:] == b[4:]
                      and a[3][:7] == b[3][:7] and len(a[3]) == len(b[3]))
    if not same:
        assert not np.array_equal(fa2, fb), (a, b)
