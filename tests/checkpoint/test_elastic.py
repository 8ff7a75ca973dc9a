"""Resuming on another world size: the rest of an epoch re-split, ZeRO re-partitioned.

The sampler maths is checked against the epoch order itself (``epoch_order``, which
reproduces torch's ``randperm``); ZeRO and comm-hook state are checked in one process
whose DDP runs over 8 and then 4 of its virtual devices.
"""

from __future__ import annotations

import collections
import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from jdist.checkpoint import CheckpointManager, CheckpointMismatchError, ResumedSampler
from jdist.checkpoint._elastic import resume_sampler
from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.optim._zero import _to_host
from jdist.sampler import DistributedSampler, epoch_order
from tests.checkpoint.train_job import build, digest, run

N = 96


def _take(samplers, k):
    its = [iter(s) for s in samplers]
    return [list(itertools.islice(it, k)) for it in its]


def _world(n_ranks, **kw):
    return [DistributedSampler(N, n_ranks, r, seed=1, **kw) for r in range(n_ranks)]


def test_four_to_three_to_four_sees_every_sample_once():
    order = epoch_order(N, shuffle=True, seed=1, epoch=0)
    four = _world(4)
    used = _take(four, 7)  # 28 samples: the prefix order[:28]
    assert sorted(sum(used, [])) == sorted(order[:28].tolist())
    states = [s.state_dict() for s in four]
    three = [resume_sampler(s, states, r, 4, "s") for r, s in enumerate(_world(3))]
    assert all(isinstance(s, ResumedSampler) and len(s) == 23 for s in three)  # 68 -> 69
    used3 = _take(three, 5)  # 15 more: order[28:43]
    assert sorted(sum(used3, [])) == sorted(order[28:43].tolist())
    states3 = [s.state_dict() for s in three]
    assert {s["offset"] for s in states3} == {28} and {s["consumed"] for s in states3} == {5}
    back = [resume_sampler(s, states3, r, 3, "s") for r, s in enumerate(_world(4))]
    rest = [list(s) for s in back]  # 53 left, padded to 56 by repeating its first 3
    seen = collections.Counter(sum(used, []) + sum(used3, []) + sum(rest, []))
    assert set(seen) == set(range(N))
    assert sorted(i for i, c in seen.items() if c == 2) == sorted(order[43:46].tolist())
    # the next epoch is the plain sampler's again, for the new world
    for r, s in enumerate(back):
        s.set_epoch(1)
        fresh = DistributedSampler(N, 4, r, seed=1)
        fresh.set_epoch(1)
        assert s.indices().tolist() == fresh.indices().tolist()


def test_drop_last_cuts_the_rest_and_same_world_restart_keeps_the_offset():
    four = _world(4, drop_last=True)
    _take(four, 6)  # 24 of 96
    states = [s.state_dict() for s in four]
    three = [resume_sampler(s, states, r, 4, "s") for r, s in enumerate(_world(3, drop_last=True))]
    assert {len(s) for s in three} == {24}  # 72 left: fits 3 ranks exactly
    _take(three, 10)
    st = [s.state_dict() for s in three]
    again = [resume_sampler(s, st, r, 3, "s") for r, s in enumerate(_world(3, drop_last=True))]
    loaded = ResumedSampler(_world(3, drop_last=True)[1], 0, 0)
    loaded.load_state_dict(st[1])  # the same, through the sampler API
    assert loaded.indices().tolist() == again[1].indices().tolist()
    assert list(loaded) == again[1].indices()[10:].tolist()
    rest = [list(s) for s in again]
    order = epoch_order(N, shuffle=True, seed=1, epoch=0)
    assert sorted(sum(rest, [])) == sorted(order[24 + 30:].tolist())
    five = [resume_sampler(s, st, r, 3, "s") for r, s in enumerate(_world(5, drop_last=True))]
    got = sum((list(s) for s in five), [])
    assert len(got) == 40 and set(got) <= set(order[54:].tolist())  # 42 -> 40: 2 dropped


def test_resize_needs_elastic_and_equal_progress():
    four = _world(4)
    states = [s.state_dict() for s in four]
    with pytest.raises(CheckpointMismatchError, match="pass elastic=True"):
        resume_sampler(_world(3)[0], states, 0, 4, "train", elastic=False)
    states[2]["consumed"] = 3
    with pytest.raises(CheckpointMismatchError, match=r"consumed different numbers of "
                                                      r"samples \[0, 0, 3, 0\]"):
        resume_sampler(_world(3)[0], states, 0, 4, "train")


def _group(n):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"ckpt{n}")


def _zero_full(state):
    return [_to_host(x) for x in jax.tree.leaves(nnx.state(state["optimizer"]).to_pure_dict())]


def test_zero_shards_restore_exactly_and_repartition_for_fewer_replicas(tmp_path):
    def make(n):
        return build(0, 1, hook=False, zero=True, group=_group(n))

    ref_dir, dir_ = tmp_path / "ref", tmp_path / "ck"
    m = CheckpointManager(ref_dir, save_interval_steps=3)
    ref = run(m, m.restore_or_init(lambda: make(8)), 5, 16)
    m.close()
    m = CheckpointManager(dir_, save_interval_steps=3)
    run(m, m.restore_or_init(lambda: make(8)), 4, 16)
    m.close()
    saved = CheckpointManager(dir_)
    again = saved.restore_or_init(lambda: make(8))  # same world: each shard back in place
    assert saved.restored_step == 3
    run(saved, again, 5, 16)
    saved.close()
    assert digest(again) == digest(ref)
    # 4 replicas: the 8 shards' data re-split into 4 (padding 0 of 8 -> 0 of 4)
    m = CheckpointManager(ref_dir, save_interval_steps=3)
    before = _zero_full(m.restore(make(8)))
    small = m.restore(make(4))
    assert m.restored_step == 3
    for a, b in zip(before, _zero_full(small), strict=True):
        n = min(a.size, b.size)
        np.testing.assert_array_equal(a.reshape(-1)[:n], b.reshape(-1)[:n])
    m.close()


def test_hook_state_of_another_replica_count_is_refused_or_reset(tmp_path):
    m = CheckpointManager(tmp_path, save_interval_steps=2)
    run(m, m.restore_or_init(lambda: build(0, 1)), 2, 16)  # PowerSGD over 8 replicas
    m.close()
    m = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"saved for 8 replicas and this job "
                                                      r"has 4.*reset_hook_state_on_resize"):
        m.restore(build(0, 1, group=_group(4)))
    m.close()
    m = CheckpointManager(tmp_path, reset_hook_state_on_resize=True)
    with pytest.warns(UserWarning, match="starts afresh"):
        state = m.restore(build(0, 1, group=_group(4)))
    run(m, state, 3, 16)  # trains on with fresh PowerSGD memories
    assert state["step"] == 3
    m.close()
