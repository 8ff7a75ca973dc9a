"""``examples/train_resume.py --smoke`` under ``jdist-run``: a killed rank, a restart,
and a resume from the newest checkpoint (one process with 2 virtual devices)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "train_resume.py")


@pytest.mark.slow(seconds=10)
def test_example_restarts_after_the_kill_and_resumes_from_the_last_save(tmp_path):
    env = dict(os.environ)  # with the suite's compilation cache (tests/conftest.py)
    # the suite's XLA flags but its 8 devices: a worker has one unless
    # --devices-per-proc says otherwise
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, "-m", "jdist.launch", "--nproc-per-node", "1",
           "--devices-per-proc", "2", "--max-restarts", "1", EXAMPLE, "--ckpt",
           str(tmp_path / "ck"), "--smoke", "--save-every", "2", "--kill-at", "3"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout
    assert "attempt 0: a fresh start" in out
    assert "rank 0: killing myself after step 3" in out
    assert "restarting the job (attempt 2 of 2)" in res.stderr
    assert "attempt 1: resumed from step 2" in out  # step 3 was lost with the kill
    assert "done: 6 steps" in out and "1 restart(s)" in out
    assert sorted(os.listdir(tmp_path / "ck")) == ["step_00000004", "step_00000006"]
