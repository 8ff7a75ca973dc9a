"""The pure decisions of jdist.ft (``_rules``) and the exactly-once sampler, as
properties checked against independent references (no store, no sockets)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.ft import DistributedSampler, split_counts, weighted_mean
from jdist.ft._rules import heal_plan, may_seal
from jdist.sampler import epoch_order

# -- split_counts ---------------------------------------------------------------------


@settings(max_examples=300)
@given(remaining=st.integers(0, 500), members=st.integers(1, 12), batch=st.integers(1, 16))
def test_split_counts_sums_and_balance(remaining, members, batch):
    counts = split_counts(remaining, members, batch)
    assert len(counts) == members
    assert all(isinstance(c, int) and c >= 0 for c in counts)
    assert sum(counts) == min(remaining, members * batch)
    assert max(counts) - min(counts) <= 1
    assert max(counts) <= batch
    # earlier members take the larger share: the list never increases
    assert all(a >= b for a, b in itertools.pairwise(counts))
    if remaining >= members * batch:
        assert counts == [batch] * members


@pytest.mark.parametrize("args", [(5, 0, 1), (5, -1, 1), (5, 2, 0), (5, 2, -3), (-1, 2, 2)])
def test_split_counts_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        split_counts(*args)


# -- weighted_mean --------------------------------------------------------------------

# 0-d leaves have their own test below (test_weighted_mean_zero_d_leaves)
_shapes = st.sampled_from([(), (1,), (3,), (2, 3)])
_dtypes = st.sampled_from([np.float32, np.float64])


@st.composite
def _members(draw):
    """(parts, counts): 1..6 members, each with the same leaves (shape, dtype)."""
    leaves = draw(st.lists(st.tuples(_shapes, _dtypes), min_size=1, max_size=3))
    n = draw(st.integers(1, 6))
    counts = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    if not any(counts):
        counts[draw(st.integers(0, n - 1))] = draw(st.integers(1, 64))
    values = st.floats(-1e3, 1e3, allow_nan=False, width=32)
    parts = []
    for _ in range(n):
        member = []
        for shape, dtype in leaves:
            size = int(np.prod(shape))
            flat = draw(st.lists(values, min_size=size, max_size=size))
            member.append(np.asarray(flat, dtype).reshape(shape))
        parts.append(member)
    return parts, counts


def _reference(parts, counts):
    """float64, written from the definition: sum_i c_i p_i / sum_i c_i, and a bound on
    the float32 rounding error (proportional to sum_i |c_i p_i| / sum_i c_i)."""
    total = float(sum(counts))
    out, scale = [], []
    for j in range(len(parts[0])):
        num = np.zeros(np.shape(parts[0][j]), np.float64)
        mag = np.zeros_like(num)
        for member, c in zip(parts, counts, strict=True):
            if c:
                num += c * member[j].astype(np.float64)
                mag += c * np.abs(member[j].astype(np.float64))
        out.append(num / total)
        scale.append(mag / total)
    return out, scale


@settings(max_examples=200)
@given(data=_members())
def test_weighted_mean_matches_float64_reference(data):
    parts, counts = data
    got = weighted_mean(parts, counts)
    want, scale = _reference(parts, counts)
    assert len(got) == len(want)
    for g, w, s, leaf in zip(got, want, scale, parts[0], strict=True):
        assert isinstance(g, np.ndarray) and g.ctypes.data % 64 == 0  # (placed copy-free)
        assert g.shape == w.shape
        assert g.dtype == leaf.dtype
        err = np.abs(g.astype(np.float64) - w)
        assert np.all(err <= 1e-5 * (np.abs(w) + s) + 1e-30), (g, w, err)


def _bits(arrays):
    return [np.asarray(a).tobytes() for a in arrays]


@settings(max_examples=100)
@given(data=_members())
def test_weighted_mean_is_bitwise_deterministic(data):
    parts, counts = data
    first = weighted_mean(parts, counts)
    copies = [[leaf.copy() for leaf in member] for member in parts]
    assert _bits(weighted_mean(copies, list(counts))) == _bits(first)
    assert _bits(weighted_mean(parts, counts)) == _bits(first)


@settings(max_examples=100)
@given(data=_members(), garbage=st.sampled_from([np.nan, np.inf, -np.inf, 3e38]))
def test_weighted_mean_ignores_zero_count_members(data, garbage):
    parts, counts = data
    kept = [(p, c) for p, c in zip(parts, counts, strict=True) if c]
    want = weighted_mean([p for p, _ in kept], [c for _, c in kept])
    # a member with no samples may hold anything (a NaN loss's gradient): it adds nothing
    poisoned = [[np.full_like(leaf, garbage) for leaf in p] if c == 0 else p
                for p, c in zip(parts, counts, strict=True)]
    zero_first = [[np.full_like(leaf, garbage) for leaf in parts[0]], *poisoned]
    got = weighted_mean(poisoned, counts)
    assert _bits(got) == _bits(want)
    got = weighted_mean(zero_first, [0, *counts])
    assert _bits(got) == _bits(want)


def test_weighted_mean_member_order_is_the_summation_order():
    """The sum runs in member order: a value that cancels exactly in one order and not
    in another shows it (every replica must list the members the same way)."""
    big, small = np.float32(1e8), np.float32(1.0)
    parts = [[np.asarray([big], np.float32)], [np.asarray([small], np.float32)],
             [np.asarray([-big], np.float32)]]
    counts = [1, 1, 1]
    in_order = weighted_mean(parts, counts)[0]
    # ((1e8 + 1) - 1e8) / 3 in float32: the 1 is lost in the first addition
    assert in_order[0] == np.float32(0.0)
    other = weighted_mean([parts[0], parts[2], parts[1]], counts)[0]
    assert other[0] == np.float32(1.0) / np.float32(3.0)


@pytest.mark.parametrize("counts", [[3], [1, 2], [2, 0, 5]])
def test_weighted_mean_zero_d_leaves(counts):
    parts = [[np.asarray(1.5 * (i + 1), np.float32), np.asarray(-2.0 * i, np.float64)]
             for i in range(len(counts))]
    got = weighted_mean(parts, counts)
    want, _ = _reference(parts, counts)
    for g, w, leaf in zip(got, want, parts[0], strict=True):
        assert np.shape(g) == () and np.asarray(g).dtype == leaf.dtype
        np.testing.assert_allclose(np.float64(g), w, rtol=1e-6)


def test_weighted_mean_zero_d_leaves_three_members():
    parts = [[np.asarray(float(i), np.float32)] for i in range(3)]
    got = weighted_mean(parts, [1, 1, 1])
    np.testing.assert_allclose(np.float64(got[0]), 1.0, rtol=1e-6)


@pytest.mark.parametrize("counts", [[0], [0, 0], [0, 0, 0, 0]])
def test_weighted_mean_all_zero_counts_raise(counts):
    parts = [[np.ones(2, np.float32)] for _ in counts]
    with pytest.raises(ValueError):
        weighted_mean(parts, counts)


def test_weighted_mean_no_members_raises():
    with pytest.raises(ValueError):
        weighted_mean([], [])


def test_weighted_mean_negative_count_raises():
    with pytest.raises(ValueError):
        weighted_mean([[np.ones(2, np.float32)], [np.ones(2, np.float32)]], [3, -1])


# -- heal_plan ------------------------------------------------------------------------


@st.composite
def _round(draw):
    ids = draw(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True))
    steps = {r: draw(st.integers(0, 4)) for r in ids}
    synced = {r: draw(st.booleans()) for r in ids if draw(st.booleans())}  # some absent
    return steps, synced


@settings(max_examples=300)
@given(data=_round())
def test_heal_plan_sources_and_healers(data):
    steps, synced = data
    plan = heal_plan(steps, synced)
    top = max(steps.values())
    want_sources = sorted(r for r in steps if steps[r] == top and synced.get(r) is True)
    if not want_sources:
        want_sources = [min(r for r in steps if steps[r] == top)]
    sources = sorted(set(steps) - set(plan))
    assert sources == want_sources
    assert set(plan) <= set(steps)
    for healer, source in plan.items():
        assert source in sources and healer not in sources and healer != source
    # round-robin: the healers, ascending, take the sources in turn
    healers = sorted(plan)
    assert [plan[h] for h in healers] == [sources[i % len(sources)]
                                          for i in range(len(healers))]
    loads = [sum(1 for s in plan.values() if s == src) for src in sources]
    assert max(loads) - min(loads) <= 1


def test_heal_plan_examples():
    assert heal_plan({}, {}) == {}
    assert heal_plan({3: 0}, {}) == {}
    # first round: nobody synced, the lowest id at the top step is the source
    assert heal_plan({0: 0, 1: 0, 2: 0}, {}) == {1: 0, 2: 0}
    assert heal_plan({0: 0, 1: 2, 2: 2}, {0: False, 1: False, 2: False}) == {0: 1, 2: 1}
    # a synced member behind the top heals; an unsynced one at the top heals too
    assert heal_plan({0: 5, 1: 7, 2: 7, 3: 7},
                     {0: True, 1: True, 2: False, 3: True}) == {0: 1, 2: 3}


# -- may_seal -------------------------------------------------------------------------


@settings(max_examples=400)
@given(expected=st.sets(st.integers(0, 5)), joined=st.lists(st.integers(0, 5), max_size=8),
       live=st.sets(st.integers(0, 5)), min_replicas=st.integers(1, 6),
       waited=st.floats(0, 10), join_timeout=st.floats(0, 10))
def test_may_seal_properties(expected, joined, live, min_replicas, waited, join_timeout):
    sealed = may_seal(sorted(expected), joined, sorted(live), min_replicas, waited,
                      join_timeout)
    distinct = set(joined)
    if len(distinct) < min_replicas:
        assert not sealed  # never below min_replicas, however long it waited
    elif (expected & live) <= distinct:
        assert sealed  # every expected live replica is in
    elif waited >= join_timeout:
        assert sealed  # a live straggler is left out after join_timeout
    else:
        assert not sealed


@pytest.mark.parametrize("expected,joined,live,min_replicas,waited,want", [
    ([0, 1, 2], [0, 1, 2], [0, 1, 2], 1, 0.0, True),
    ([0, 1, 2], [0, 1], [0, 1, 2], 1, 0.0, False),  # 2 is live: wait for it
    ([0, 1, 2], [0, 1], [0, 1, 2], 1, 5.0, True),  # ... no longer than join_timeout
    ([0, 1, 2], [0, 1], [0, 1], 1, 0.0, True),  # 2 went silent: go on without it
    ([0, 1, 2], [0, 1], [0, 1], 3, 99.0, False),  # min_replicas=3: never with two
    ([0, 1, 2], [0, 0, 1], [0, 1], 3, 99.0, False),  # a joiner counted once
    ([0, 1], [0, 1, 3], [0, 1, 3], 3, 0.0, True),  # a newcomer is not waited for, but counts
    ([], [], [], 1, 99.0, False),
])
def test_may_seal_grid(expected, joined, live, min_replicas, waited, want):
    assert may_seal(expected, joined, live, min_replicas, waited, 5.0) is want


# -- DistributedSampler: exactly once over any membership sequence ----------------------


@settings(max_examples=150)
@given(size=st.integers(1, 200), batch=st.integers(1, 8),
       members=st.lists(st.integers(1, 6), min_size=1, max_size=40),
       epochs=st.integers(1, 3))
def test_sampler_exactly_once_per_epoch(size, batch, members, epochs):
    sampler = DistributedSampler(None, size, batch)
    used: dict[int, list[int]] = {}
    for m in itertools.cycle(members):  # the membership sequence, repeated as needed
        if sampler.epoch >= epochs:
            break
        epoch, cursor = sampler.epoch, sampler.cursor
        shares = [sampler.take(m, rank) for rank in range(m)]
        assert [len(s) for s in shares] == split_counts(size - cursor, m, batch)
        for s in shares:
            assert s.ndim == 1
            used.setdefault(epoch, []).extend(int(i) for i in s)
        sampler.advance(m)
        assert (sampler.epoch, sampler.cursor) in {(epoch, cursor + sum(map(len, shares))),
                                                   (epoch + 1, 0)}
        if sampler.epoch != epoch:
            assert cursor + sum(map(len, shares)) == size
    assert sorted(used) == list(range(epochs))
    for e, got in used.items():
        assert sorted(got) == list(range(size)), f"epoch {e}: a sample missed or repeated"
        want = epoch_order(size, shuffle=True, seed=0, epoch=e)
        assert got == [int(i) for i in want], f"epoch {e}: not the epoch's order"


def test_sampler_state_round_trip_continues_the_epoch():
    a = DistributedSampler(None, 37, 4)
    for m in (3, 1, 2):
        a.advance(m)
    b = DistributedSampler(None, 37, 4)
    b.load_state_dict(a.state_dict())
    for m in (2, 5, 5, 1):
        assert [b.take(m, r).tolist() for r in range(m)] == \
            [a.take(m, r).tolist() for r in range(m)]
        a.advance(m)
        b.advance(m)
    assert a.state_dict() == b.state_dict()
