"""Real processes under ``jdist-run --max-restarts``: killed ranks, exact resume, elastic.

Each launch checks many things at once (the machine has few cores): the kill test
runs the whole restart sequence and, in its last attempt, the uninterrupted oracle
run in the same processes; the elastic test trains on 4 processes, then resumes the
same epoch on 3 with ZeRO-1 shards re-partitioned.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from tests.checkpoint.train_job import N_SAMPLES

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_job.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(launcher_args, job_args, timeout=420):
    env = dict(os.environ)  # with the suite's compilation cache (tests/conftest.py)
    # the suite's XLA flags but its 8 devices: a worker has one unless
    # --devices-per-proc says otherwise
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, "-m", "jdist.launch", *launcher_args, JOB, *job_args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def _outputs(out_dir, world):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_three_kills_one_during_a_save_resume_bit_identical(tmp_path):
    rng = random.Random(18)  # "random" steps, the same in every run of the test
    k1 = rng.randint(2, 4)
    k2 = rng.choice([s for s in range(k1 + 2, 9) if s % 2 == 0])  # a save step
    k3 = rng.choice([s for s in range(k2 + 1, 12) if s % 2])  # between two saves
    victims = [rng.randint(0, 1) for _ in range(3)]
    kills = [f"0:{victims[0]}:{k1}", f"1:{victims[1]}:{k2}:save", f"2:{victims[2]}:{k3}"]
    out = tmp_path / "out"
    out.mkdir()
    args = ["--dir", str(tmp_path / "ck"), "--out", str(out), "--steps", "12",
            "--interval", "2", "--keep", "2", "--reference", str(tmp_path / "ref")]
    for k in kills:
        args += ["--kill", k]
    res = _launch(["--nproc-per-node", "2", "--devices-per-proc", "2", "--max-restarts", "3"],
                  args)
    assert res.returncode == 0, res.stderr[-6000:]
    for attempt in (2, 3, 4):
        assert f"restarting the job (attempt {attempt} of 4)" in res.stderr
    ranks = _outputs(out, 2)
    for r in ranks:
        assert r["attempt"] == 3
        # the last attempt resumed from the newest save before the last kill, or the
        # one before it when the kill came while that save was still being written
        assert r["resumed_from"] in (k3 - 1, k3 - 3), (kills, r["resumed_from"])
        ref = r["reference"]
        # SyncBatchNorm, Adam and PowerSGD state: bit-identical to the uninterrupted run
        assert (r["model"], r["optimizer"], r["hook"]) == (
            ref["model"], ref["optimizer"], ref["hook"]), (kills, r["rank"])
        assert r["log"] == ref["log"]  # every epoch: the same indices in the same order
    # the two ranks together saw each sample of the full epoch 0 exactly once
    both = ranks[0]["log"]["0"] + ranks[1]["log"]["0"]
    assert sorted(both) == list(range(N_SAMPLES))


@pytest.mark.slow
def test_elastic_4_to_3_processes_resumes_the_epoch_and_repartitions_zero(tmp_path):
    ck = tmp_path / "ck"
    first, second = tmp_path / "four", tmp_path / "three"
    first.mkdir()
    second.mkdir()
    common = ["--dir", str(ck), "--interval", "3", "--keep", "2", "--batch", "4",
              "--zero", "--no-hook", "--elastic"]
    # 4 processes x 4 samples: 3 steps consume 48 of the 96 samples of epoch 0
    res = _launch(["--nproc-per-node", "4"], ["--out", str(first), "--steps", "3", *common])
    assert res.returncode == 0, res.stderr[-6000:]
    # 3 processes resume epoch 0 from step 3: the other 48 samples are 4 steps of 3 x 4
    res = _launch(["--nproc-per-node", "3"], ["--out", str(second), "--steps", "7", *common])
    assert res.returncode == 0, res.stderr[-6000:]
    four, three = _outputs(first, 4), _outputs(second, 3)
    assert {r["resumed_from"] for r in three} == {3}
    assert all(len(r["log"]["0"]) == 12 for r in four)
    # each new rank restored its namesake's log (12 indices) and consumed 16 more
    assert all(len(r["log"]["0"]) == 12 + 16 for r in three)
    seen = [i for r in four for i in r["log"]["0"]] + [i for r in three
                                                       for i in r["log"]["0"][12:]]
    assert sorted(seen) == list(range(N_SAMPLES))  # every index of the epoch exactly once
    # ZeRO-1: the state consolidated right after the restore on 3 replicas (shards
    # re-partitioned from 4) holds exactly the data of the 4-replica state it resumed
    for a, b in zip(four[0]["zero_final"], three[0]["zero_after_restore"], strict=True):
        a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
        n = min(a.size, b.size)
        np.testing.assert_array_equal(a[:n], b[:n])
        assert not a[n:].any() and not b[n:].any()  # the rest is padding
    assert len({r["model"] for r in three}) == 1  # replicas agree after resumed steps
