"""A job that never calls destroy_process_group() still exits cleanly on every rank.

Without the exit teardown, rank 0 (host of JAX's coordination service) can leave first
and JAX aborts the ranks that are still disconnecting (SIGABRT, "Check failure").
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import jdist
    jdist.init_process_group()
    rank = jdist.get_rank()
    total = jdist.all_reduce(np.ones(2, np.float32))
    assert total.tolist() == [2.0, 2.0], total
    if os.environ["MODE"] == "fail" and rank == 1:
        sys.exit(3)           # leaves while rank 0 waits in a collective
    if os.environ["MODE"] == "fail":
        jdist.all_reduce(np.ones(2, np.float32))
    if rank == 1:
        time.sleep(2.0)       # rank 0 (the JAX service host) finishes first
    print("done", rank)
""")


def _launch(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "MODE": mode,
           "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=180)
    return out, time.monotonic() - start


def test_job_without_destroy_exits_cleanly_when_rank0_finishes_first(tmp_path):
    out, _ = _launch(tmp_path, "clean")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[rank 0] done 0" in out.stdout and "[rank 1] done 1" in out.stdout
    assert "Check failure" not in out.stdout + out.stderr


def test_rank_leaving_with_sys_exit_ends_the_job_promptly(tmp_path):
    out, took = _launch(tmp_path, "fail")
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    assert "rank 1" in out.stderr
    # start-up (JAX import, rendezvous) plus the 5 s exit barrier; far below the 30 s
    # collective timeout or the group timeout
    assert took < 60, took
