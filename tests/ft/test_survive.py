"""jdist.ft with real processes: 4 replicas train (DDP + Adam) through SIGKILL of rank
2, then of rank 0 (the lowest rank: nothing lives in it), and a SIGSTOP of rank 1.

Checked against independent references: the survivors keep their PIDs (no restart),
each replacement heals (it finishes with the others' bits), the final parameters equal
a one-process replay of the ledger's membership sequence bit for bit, every sample of
an epoch is used exactly once, and the stopped replica is reported by every other one
(rank, step, operation, stack, "stopped") within twice the heartbeat deadline.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jdist.ft import split_counts
from jdist.sampler import epoch_order

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ft.py"
DEADLINE = 2.0  # the replicas' heartbeat timeout (--heartbeat-timeout)
SAMPLES, BATCH = 96, 4  # examples/train_ft.py's
pytestmark = pytest.mark.timeout(300)


def _records(out: Path) -> list[dict]:
    recs = []
    for path in glob.glob(str(out / "ledger_*.jsonl")):
        with open(path) as f:
            recs += [json.loads(line) for line in f if line.endswith("\n")]
    return recs


def _until(pred, seconds: float, what: str, job: subprocess.Popen, log: Path):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        if job.poll() is not None:
            break
        time.sleep(0.1)
    job.kill()
    pytest.fail(f"waited {seconds:.0f} s for {what}; output:\n{log.read_text()[-6000:]}")


def _pid(out: Path, rank: int, inc: int) -> int:
    return json.loads((out / f"pid_{rank}_{inc}").read_text())["pid"]


def _joined(out: Path, rank: int, inc: int, after: int = 0):
    """The first committed step after ``after`` that ``rank``'s incarnation ``inc`` was in."""
    steps = [r["step"] for r in _records(out)
             if r["replica"] == rank and r["inc"] == inc and r["step"] > after]
    return min(steps) if steps else None


def _top(out: Path) -> int:
    return max((r["step"] for r in _records(out)), default=0)


def _check_ledger(out: Path) -> None:
    """Per step the members agree; every epoch's samples are used exactly once.

    A member killed between a step's commit and its ledger line leaves no line for
    that step, so each member's share is computed from the step's record (epoch,
    position, members: the split is torch's epoch order cut into ``split_counts``
    slices) and every line that was written must equal it."""
    by_step: dict[int, dict[int, dict]] = {}
    for r in _records(out):
        by_step.setdefault(r["step"], {})[r["replica"]] = r
    steps = sorted(by_step)
    assert steps == list(range(1, steps[-1] + 1)), "a committed step is missing"
    seen: dict[int, list[int]] = {}
    for s in steps:
        recs = by_step[s]
        first = next(iter(recs.values()))
        assert all(r["members"] == first["members"] and r["epoch"] == first["epoch"]
                   and r["cursor"] == first["cursor"] for r in recs.values()), s
        members = first["members"]
        order = epoch_order(SAMPLES, shuffle=True, seed=0, epoch=first["epoch"])
        counts = split_counts(SAMPLES - first["cursor"], len(members), BATCH)
        start = first["cursor"]
        for m, n in zip(members, counts, strict=True):
            share = order[start:start + n].tolist()
            start += n
            if m in recs:
                assert recs[m]["indices"] == share, (s, m)
            seen.setdefault(first["epoch"], []).extend(share)
    last = max(seen)
    for epoch, used in seen.items():
        assert len(used) == len(set(used)), f"epoch {epoch} used a sample twice"
        if epoch < last:
            assert sorted(used) == list(range(SAMPLES)), f"epoch {epoch} missed samples"


@pytest.mark.slow(seconds=40)  # a long end-to-end run
def test_replicas_survive_kills_and_a_stop(tmp_path):
    out, log = tmp_path / "out", tmp_path / "log.txt"
    stop = tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "jdist.launch", "--ft", "--nproc-per-node", "4",
           "--start-method", "forkserver",  # (replacements start without imports)
           "--max-restarts", "2", "--devices-per-proc", "1", str(EXAMPLE), "--out", str(out),
           "--steps", "100000", "--sleep", "0.03", "--every", "1000",
           "--heartbeat-timeout", str(DEADLINE), "--timeout", "20", "--stop-file", str(stop)]
    with open(log, "wb") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    try:
        _until(lambda: _top(out) >= 30, 120, "30 committed steps", job, log)
        quiet = log.read_text()  # 30 normal steps: nobody reported anybody
        first = {r: _pid(out, r, 0) for r in range(4)}
        os.kill(first[2], signal.SIGKILL)
        t2 = _top(out)
        _until(lambda: _joined(out, 2, 1, t2), 90, "rank 2's replacement to commit", job, log)
        os.kill(first[0], signal.SIGKILL)
        t0 = _top(out)
        _until(lambda: _joined(out, 0, 1, t0), 90, "rank 0's replacement to commit", job, log)
        mark = len(log.read_bytes())
        os.kill(first[1], signal.SIGSTOP)
        stopped_at = time.monotonic()

        def reported():
            text = log.read_bytes()[mark:].decode(errors="replace")
            lines = [ln for ln in text.splitlines() if "replica 1 (pid" in ln and
                     "process is stopped" in ln]
            who = {ln.split("]")[0] for ln in lines}
            return lines if len(who) == 3 else None

        lines = _until(reported, 30, "every other rank to report the stopped rank 1", job, log)
        took = time.monotonic() - stopped_at
        os.kill(first[1], signal.SIGCONT)
        t1 = _top(out)
        _until(lambda: _joined(out, 1, 0, t1 + 1), 60, "rank 1 to rejoin", job, log)
        stop.touch()
        job.wait(60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = log.read_text()
    assert job.returncode == 0, text[-6000:]
    assert "jdist.ft:" not in quiet, quiet[-3000:]
    for r in range(4):  # each of the 3 events costs a round or two, no more
        assert text.count(f"[rank {r}] jdist.ft: replica {r} at step") <= 6, text[-6000:]
    assert took <= 2 * DEADLINE + 1.0, (took, lines)  # (+1 s: this test's polling)
    assert all("is at step" in ln and "in '" in ln for ln in lines), lines
    assert "its last published stack" in text and "train_ft.py" in text
    results = {r: json.loads((out / f"result_{r}.json").read_text()) for r in range(4)}
    for r in (1, 3):  # survivors: the same processes from start to end
        assert results[r]["pid"] == first[r] and results[r]["incarnation"] == 0
    for r in (0, 2):  # replaced once each, by a new process
        assert results[r]["incarnation"] == 1 and results[r]["pid"] != first[r]
    assert len({results[r]["step"] for r in range(4)}) == 1
    _check_ledger(out)
    worker_env = json.loads((out / "pid_3_0").read_text())["env"]
    subprocess.run([sys.executable, str(EXAMPLE), "--replay", str(out)], check=True,
                   timeout=120, env={**env, **worker_env})
    replay = np.load(out / "replay.npz")
    for r in range(4):
        final = np.load(out / f"final_{r}.npz")
        for k in replay.files:
            np.testing.assert_array_equal(final[k], replay[k], err_msg=f"rank {r} {k}")
