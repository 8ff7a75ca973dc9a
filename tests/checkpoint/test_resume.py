"""In-process checkpoints: exact resume, retention, partial and corrupt steps, bad input.

One process with the 8 virtual devices of conftest: DDP over 8 replicas (SyncBatchNorm,
Adam, PowerSGD), so every kind of state is saved; the oracle is the uninterrupted run
of the same job (the same code with no checkpoint read back).
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    PerRank,
    _layout,
)
from tests.checkpoint.train_job import build, digest, run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 10 steps of 16 samples (one epoch is 6 steps)."""
    d = tmp_path_factory.mktemp("ref")
    m = CheckpointManager(d, save_interval_steps=4)
    state = m.restore_or_init(lambda: build(0, 1))
    run(m, state, 10, 16)
    m.close()
    return {"digest": digest(state), "log": state["log"], "dir": str(d),
            "steps": m.all_steps()}


def test_restart_mid_epoch_is_bit_identical(reference, tmp_path):
    assert reference["steps"] == [4, 8]
    m = CheckpointManager(tmp_path, save_interval_steps=4)
    state = m.restore_or_init(lambda: build(0, 1))
    assert m.restored_step is None
    run(m, state, 9, 16)  # "killed" after step 9: step 8 is the newest checkpoint
    m.close()
    m = CheckpointManager(tmp_path, save_interval_steps=4)
    state = m.restore_or_init(lambda: build(0, 1))
    assert m.restored_step == 8 and state["step"] == 8
    assert state["sampler"].state_dict()["epoch"] == 1
    assert state["sampler"].state_dict()["consumed"] == 2 * 16  # 8 steps - 6 of epoch 0
    run(m, state, 10, 16)
    m.close()
    got = digest(state)
    assert got == reference["digest"]  # params, buffers, Adam state, PowerSGD memories
    assert state["log"] == reference["log"]  # per-epoch consumed indices, in order
    assert sorted(state["log"]["0"]) == list(range(96))


def test_interval_retention_and_one_save_in_flight(tmp_path):
    x = {"w": np.arange(6.0).reshape(2, 3)}
    m = CheckpointManager(tmp_path, save_interval_steps=2, max_to_keep=2)
    assert m.save(1, {"p": x}) is False  # off the interval
    for step in (2, 4, 6):
        assert m.save(step, {"p": x, "step": step}) is True
        # the previous save finished before this one started (at most one in flight)
        done = [s.step for s in _layout.scan(str(tmp_path)) if s.complete_world() == 1]
        assert step - 2 in done or step == 2
    m.close()
    assert m.all_steps() == [4, 6]  # max_to_keep
    m2 = CheckpointManager(tmp_path)
    out = m2.restore({"p": {"w": np.zeros((2, 3))}, "step": 0})
    np.testing.assert_array_equal(out["p"]["w"], x["w"])
    assert out["step"] == 6
    assert m2.save(6, out) is False  # the step it resumed from is complete already
    m2.close()


def _tree_state(v=1.0):
    return {"params": {"a": np.full((3,), v, np.float32), "b": [np.int32(4)]},
            "mine": PerRank({"k": jax.random.key(7)}), "extras": {"lr": 0.1, "tags": ["x"]},
            "gen": np.random.default_rng(3)}


def test_pytrees_keys_json_and_generators_round_trip(tmp_path):
    st = _tree_state(2.5)
    st["gen"].normal(size=5)
    expect = st["gen"].normal(size=3)
    st["gen"] = np.random.default_rng(3)
    st["gen"].normal(size=5)
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, st)
    tmpl = _tree_state(0.0)
    with CheckpointManager(tmp_path) as m:
        out = m.restore(tmpl)
    np.testing.assert_array_equal(out["params"]["a"], np.full((3,), 2.5, np.float32))
    assert out["params"]["b"][0] == 4
    assert out["extras"] == {"lr": 0.1, "tags": ["x"]}
    np.testing.assert_array_equal(jax.random.key_data(out["mine"]["k"]),
                                  jax.random.key_data(jax.random.key(7)))
    assert out["gen"] is tmpl["gen"]  # restored in place
    np.testing.assert_array_equal(tmpl["gen"].normal(size=3), expect)


def test_restore_or_init_first_launch_and_a_first_save_that_never_finished(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(5, _tree_state())
    # the part looks as a kill in the middle of Orbax's write leaves it
    step = _layout.step_dir(str(tmp_path), 5)
    part = os.path.join(step, _layout.part_name(0, 1))
    os.rename(part, part + ".orbax-checkpoint-tmp")
    m = CheckpointManager(tmp_path)
    assert m.latest_step() is None
    calls = []
    out = m.restore_or_init(lambda: calls.append(1) or _tree_state(9.0))
    assert calls == [1] and out["params"]["a"][0] == 9.0 and m.restored_step is None
    assert not os.path.exists(step)  # leftovers of the unfinished write are removed
    m.close()


def test_partial_newest_step_is_skipped_and_removed(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, _tree_state(1.0))
        m.save(2, _tree_state(2.0))
    shutil.rmtree(os.path.join(_layout.step_dir(str(tmp_path), 2), _layout.part_name(0, 1)))
    os.makedirs(os.path.join(_layout.step_dir(str(tmp_path), 2), "rank_00000_of_00001"
                             ".orbax-checkpoint-tmp"))
    m = CheckpointManager(tmp_path)
    out = m.restore_or_init(lambda: _tree_state(0.0))
    assert m.restored_step == 1 and out["params"]["a"][0] == 1.0
    assert m.all_steps() == [1] and not os.path.exists(_layout.step_dir(str(tmp_path), 2))
    m.close()


def _data_files(part):
    """The chunk files of a part's buffers (``arrays/<buffer>/0``; an OCDBT part, as
    jdist wrote before, keeps its data under ``d/``)."""
    out = []
    for root, _, files in os.walk(os.path.join(part, "arrays")):
        if os.path.basename(root).endswith("_buffer"):
            out += [os.path.join(root, f) for f in files if not f.startswith(".")]
        elif os.path.basename(root) == "d":
            out += [os.path.join(root, f) for f in files]
    return out


def test_corrupt_step_warns_naming_the_file_and_falls_back(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, _tree_state(1.0))
        m.save(2, _tree_state(2.0))
    part2 = os.path.join(_layout.step_dir(str(tmp_path), 2), _layout.part_name(0, 1))
    files = _data_files(part2)
    assert files
    for f in files:  # truncate every data file of step 2
        with open(f, "r+b") as fh:
            fh.truncate(max(0, os.path.getsize(f) // 2))
    m = CheckpointManager(tmp_path)
    with pytest.warns(UserWarning, match=r"skipping checkpoint step 2: .*rank_00000_of_00001"):
        out = m.restore(_tree_state(0.0))
    assert m.restored_step == 1 and out["params"]["a"][0] == 1.0
    m.close()
    part1 = os.path.join(_layout.step_dir(str(tmp_path), 1), _layout.part_name(0, 1))
    for f in _data_files(part1):
        with open(f, "r+b") as fh:
            fh.truncate(0)
    m = CheckpointManager(tmp_path)
    with pytest.warns(UserWarning), pytest.raises(CheckpointCorruptError,
                                                   match="step_00000001"):
        m.restore(_tree_state(0.0))
    m.close()


def test_changed_bytes_fail_the_checksum(tmp_path, monkeypatch):
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, _tree_state(1.0))
    from jdist.checkpoint import _orbax

    real = _orbax.read_part

    def flipped(path, with_arrays, names=None):
        arrays, meta = real(path, with_arrays, names)
        if "float32_buffer" in arrays:  # every float32 piece of the part, packed
            arrays["float32_buffer"] = arrays["float32_buffer"] + 1  # as a flipped bit would
        return arrays, meta

    monkeypatch.setattr("jdist.checkpoint._restore.read_part", flipped)
    m = CheckpointManager(tmp_path)
    with pytest.warns(UserWarning), pytest.raises(CheckpointCorruptError,
                                                   match=r"'float32_buffer'.*checksum"):
        m.restore(_tree_state(0.0))
    m.close()


def test_a_part_written_by_an_earlier_jdist_restores_and_is_checked(tmp_path, monkeypatch):
    """Parts written before the XXH3 checksums and the plain zarr layout (an OCDBT
    database, a CRC-32 per buffer) still restore, and a changed byte still fails."""
    import zlib

    import orbax.checkpoint as ocp

    from jdist.checkpoint import _manager, _pack

    real_handler = ocp.PyTreeCheckpointHandler

    def ocdbt_handler(**kw):
        return real_handler(**{**kw, "use_ocdbt": True})

    with monkeypatch.context() as mp:
        mp.setattr(ocp, "PyTreeCheckpointHandler", ocdbt_handler)
        mp.setattr(_manager._pack, "buffer_checksum",
                   lambda a: {"crc": zlib.crc32(memoryview(a).cast("B"))})
        with CheckpointManager(tmp_path, async_save=False) as m:
            m.save(1, _tree_state(1.0))
            m.save(2, _tree_state(2.0))
    part2 = os.path.join(_layout.step_dir(str(tmp_path), 2), _layout.part_name(0, 1))
    assert os.path.exists(os.path.join(part2, "arrays", "manifest.ocdbt"))
    with CheckpointManager(tmp_path) as m:
        out = m.restore(_tree_state(0.0))
    assert m.restored_step == 2 and out["params"]["a"][0] == 2.0
    buf = np.arange(5, dtype=np.float32)
    assert _pack.checksum_ok(buf, {"crc": zlib.crc32(buf.tobytes())})
    assert not _pack.checksum_ok(buf + 1, {"crc": zlib.crc32(buf.tobytes())})
    assert not _pack.checksum_ok(buf, {})  # a record with no checksum is not trusted
    files = _data_files(part2)
    assert files
    for f in files:  # step 2's data cut in half: the CRC-32 era part falls back too
        with open(f, "r+b") as fh:
            fh.truncate(max(0, os.path.getsize(f) // 2))
    with CheckpointManager(tmp_path) as m, pytest.warns(
            UserWarning, match="skipping checkpoint step 2"):
        out = m.restore(_tree_state(0.0))
    assert m.restored_step == 1 and out["params"]["a"][0] == 1.0


class _Net(nnx.Module):
    def __init__(self, hidden, extra=False):
        rngs = nnx.Rngs(0)
        self.fc1 = nnx.Linear(4, hidden, rngs=rngs)
        if extra:
            self.fc15 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, 2, rngs=rngs)


def test_restoring_into_another_model_names_the_path_and_both_shapes(tmp_path):
    net = _Net(8)
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, {"model": net, "opt": nnx.Optimizer(net, optax.adam(1e-3), wrt=nnx.Param)})
    m = CheckpointManager(tmp_path)
    other = _Net(9)
    with pytest.raises(CheckpointMismatchError,
                       match=r"'fc1/bias' was saved with shape \(8,\), the restore target "
                             r"has shape \(9,\)"):
        m.restore({"model": other, "opt": nnx.Optimizer(other, optax.adam(1e-3),
                                                        wrt=nnx.Param)})
    np.testing.assert_array_equal(np.asarray(other.fc1.bias[...]), np.zeros(9))  # untouched
    deeper = _Net(8, extra=True)
    with pytest.raises(CheckpointMismatchError, match=r"first differing path.*'fc2/bias'.*"
                                                      r"'fc15/bias'"):
        m.restore({"model": deeper, "opt": nnx.Optimizer(deeper, optax.adam(1e-3),
                                                         wrt=nnx.Param)})
    with pytest.raises(CheckpointMismatchError, match=r"missing from the target: \['opt'\]"):
        m.restore({"model": _Net(8)})
    m.close()


def _fake_part(root, step, rank, world):
    path = os.path.join(_layout.step_dir(str(root), step), _layout.part_name(rank, world))
    os.makedirs(path)


def test_directory_of_another_job_is_refused_saying_what_is_missing(tmp_path):
    for r in range(4):
        _fake_part(tmp_path / "four", 10, r, 4)
    m = CheckpointManager(tmp_path / "four")
    with pytest.raises(CheckpointError, match=r"4-process job .*step 10.*this job has 1 "
                                              r"processes; pass elastic=True"):
        m.restore_or_init(lambda: _tree_state())
    m.close()
    for step in (10, 20):
        for r in (0, 1):
            _fake_part(tmp_path / "lost", step, r, 4)
    m = CheckpointManager(tmp_path / "lost")
    with pytest.raises(CheckpointError, match=r"no step that every rank finished: step 20 "
                                              r"has the parts of ranks \[0, 1\] of a "
                                              r"4-process job, missing ranks \[2, 3\]"):
        m.restore_or_init(lambda: _tree_state())
    m.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_arguments_name_the_value(tmp_path, bad):
    with pytest.raises(ValueError, match=rf"save_interval_steps must be an int >= 1, got "
                                         rf"{bad!r}"):
        CheckpointManager(tmp_path, save_interval_steps=bad)


def test_unsavable_value_names_the_entry(tmp_path):
    with CheckpointManager(tmp_path) as m, pytest.raises(TypeError,
                                                         match=r"state\['f'\] holds a"):
        m.save(1, {"f": object()})


def _functional(tx):
    import jax.numpy as jnp

    from jdist.ddp import FunctionalDDP

    rng = np.random.RandomState(0)
    params = {"w1": rng.randn(4, 8).astype(np.float32) * 0.5,
              "w2": rng.randn(8, 1).astype(np.float32) * 0.5}
    ddp = FunctionalDDP(params)
    ddp.opt_state = tx.init(ddp.params)  # built in init(), so that it is saved

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    return ddp, ddp.train_step(loss, tx)


def test_functional_ddp_pytrees_resume_exactly(tmp_path):
    tx = optax.adam(1e-2)
    rng = np.random.RandomState(1)
    batches = [{"x": rng.randn(16, 4).astype(np.float32),
                "y": rng.randn(16, 1).astype(np.float32)} for _ in range(4)]
    ref, ref_step = _functional(tx)
    for b in batches:
        ref_step(b)
    ddp, step = _functional(tx)
    with CheckpointManager(tmp_path, save_interval_steps=2) as m:
        for i, b in enumerate(batches[:3]):
            step(b)
            m.save(i + 1, {"ddp": ddp})
    again, step = _functional(tx)
    with CheckpointManager(tmp_path) as m:
        m.restore_or_init(lambda: {"ddp": again})
        assert m.restored_step == 2
    for b in batches[2:]:
        step(b)
    for a, b in zip(jax.tree.leaves((again.params, again.opt_state)),
                    jax.tree.leaves((ref.params, ref.opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_hung_write_raises_a_timeout_naming_the_part(tmp_path):
    import threading

    release = threading.Event()
    m = CheckpointManager(tmp_path, timeout=0.5)
    real = m._writer._ck.save

    def stuck(path, args):
        release.wait(30)  # a file system that does not answer
        real(path, args=args)

    m._writer._ck.save = lambda path, args: stuck(path, args)
    assert m.save(1, {"step": 1})
    with pytest.raises(TimeoutError, match=r"step_00000001/rank_00000_of_00001 did not "
                                           r"finish within 0.5 s"):
        m.wait()
    release.set()
    m._writer._thread.join(30)
    m._writer._thread = None
    m._writer._ck.save = real
    m.close()
    assert CheckpointManager(tmp_path).all_steps() == [1]  # the write itself went through


def test_restart_count_reads_the_launchers_variables(monkeypatch):
    from jdist.checkpoint import restart_count

    monkeypatch.delenv("JDIST_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_count() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count() == 2
    monkeypatch.setenv("JDIST_RESTART_COUNT", "3")
    assert restart_count() == 3
