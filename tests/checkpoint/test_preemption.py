"""SIGTERM reaches the program: a worker ends at once by default, as torch's does, or
saves at a step every rank agrees on and exits 143 (``save_on_preemption=True``), and
``jdist-run --max-restarts`` resumes from exactly that step.

Before jdist turned JAX's preemption service off, JAX's handler took SIGTERM and a
worker trained on until the launcher's SIGKILL (issue 41, item 2).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jdist.checkpoint import CheckpointManager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each step adds the sum over ranks of (rank + 1) to ``w`` (an eager all_reduce keeps
# the ranks in step, as a DDP step's collectives do) and saves; the state at step s is
# therefore s * world * (world + 1) / 2 everywhere.
_JOB = """\
    import os, sys, time
    import numpy as np
    import jdist
    from jdist.checkpoint import CheckpointManager, restart_count

    out, steps, opt_in = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "save"
    jdist.init_process_group()
    rank, world = jdist.get_rank(), jdist.get_world_size()
    kw = {{"save_on_preemption": True}} if opt_in else {{}}
    manager = CheckpointManager(os.path.join(out, "ck"), save_interval_steps=1000, **kw)
    state = manager.restore_or_init(lambda: {{"w": np.zeros(3, np.float32), "step": 0}})
    print(f"START attempt={{restart_count()}} step={{state['step']}} "
          f"w={{float(state['w'][0])}}", flush=True)
    while state["step"] < steps:
        total = jdist.all_reduce(np.array([rank + 1.0], np.float32))
        state["w"] = state["w"] + np.asarray(total)[0]
        state["step"] += 1
        with open(os.path.join(out, f"step{{rank}}"), "w") as f:
            f.write(f"{{state['step']}} {{os.getpid()}}")
        manager.save(state["step"], state)
        time.sleep(0.05)
    manager.close()
    print(f"DONE step={{state['step']}}", flush=True)
    jdist.destroy_process_group()
"""


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _start(tmp_path, launcher_args, job_args):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_JOB.format()))
    return subprocess.Popen(
        [sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2", *launcher_args,
         str(script), str(tmp_path), *job_args], env=_env(), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _when_rank_reaches(tmp_path, launcher, rank, step, timeout=120):
    """The pid of ``rank`` once it has finished ``step``."""
    path = tmp_path / f"step{rank}"
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if text.count(" ") == 1 and int(text.split()[0]) >= step:
            return int(text.split()[1])
        if launcher.poll() is not None or time.monotonic() > deadline:
            out, err = launcher.communicate(timeout=30)
            pytest.fail(f"rank {rank} never reached step {step}:\n{out}\n{err[-4000:]}")
        time.sleep(0.02)


def test_sigterm_ends_a_worker_and_the_job_within_the_grace(tmp_path):
    launcher = _start(tmp_path, ["--shutdown-timeout", "5"], ["100000", "plain"])
    try:
        pid = _when_rank_reaches(tmp_path, launcher, 1, 3)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    took = time.monotonic() - t0
    assert launcher.returncode != 0
    assert "rank 1 (node 0, local rank 1) was killed by signal SIGTERM" in err, err[-3000:]
    assert "SIGTERM caught" not in err  # no JAX handler swallowed it
    assert took < 5 + 3, took  # the grace, and a little


def test_save_on_preemption_saves_the_agreed_step_and_the_restart_resumes_it(tmp_path):
    launcher = _start(tmp_path, ["--max-restarts", "1", "--shutdown-timeout", "20"],
                      ["14", "save"])
    try:
        pid = _when_rank_reaches(tmp_path, launcher, 1, 4)
        os.kill(pid, signal.SIGTERM)
        out, err = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-4000:]
    assert "rank 1 got SIGTERM; every rank saves at the next step, then exits" in err
    saved = {}
    for r in (0, 1):
        line = next(x for x in err.splitlines()
                    if f"rank {r} saved step" in x and "after SIGTERM" in x)
        saved[r] = int(line.split("saved step ")[1].split()[0])
        assert "exiting with status 143" in line
    assert saved[0] == saved[1] >= 4  # one step, the same on both ranks
    assert "exited with code 143; restarting the job (attempt 2 of 2)" in err
    starts = [x for x in out.splitlines() if "START attempt=1" in x]
    s = saved[0]
    assert len(starts) == 2 and all(f"step={s} w={3.0 * s}" in x for x in starts), out
    assert out.count("DONE step=14") == 2


def test_save_on_preemption_in_one_process(tmp_path):
    state = {"w": np.arange(4, dtype=np.float32), "step": 0}
    previous = signal.getsignal(signal.SIGTERM)
    manager = CheckpointManager(tmp_path / "ck", save_interval_steps=100,
                                save_on_preemption=True)
    try:
        assert manager.save(1, state) is False  # off the interval, no signal: nothing
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes it
        state["step"] = 2
        with pytest.raises(SystemExit) as exc:
            manager.save(2, state)
        assert exc.value.code == 143
        assert manager.all_steps() == [2]
        fresh = CheckpointManager(tmp_path / "ck")
        back = fresh.restore({"w": np.zeros(4, np.float32), "step": 0})
        fresh.close()
        np.testing.assert_array_equal(back["w"], state["w"])
        assert back["step"] == 2
    finally:
        manager.close()
    assert signal.getsignal(signal.SIGTERM) is previous  # close gives SIGTERM back


def test_save_on_preemption_needs_the_main_thread(tmp_path):
    errors = []

    def make():
        try:
            CheckpointManager(tmp_path / "ck", save_on_preemption=True)
        except ValueError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert errors and "create the CheckpointManager in the main thread" in errors[0]
