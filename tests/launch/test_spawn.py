"""jdist.launch.spawn: real processes, torch.multiprocessing.spawn's habits, no orphans."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jdist.launch import SpawnError, spawn
from tests.helpers import run_procs

ROOT = str(Path(__file__).resolve().parents[2])


def _env_of_rank():
    import jax

    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), len(jax.devices()))


def _fail_on_rank1():
    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")
    time.sleep(60)
    return "unreachable"


def test_spawn_returns_results_per_rank():
    assert run_procs(_env_of_rank, 3, devices_per_proc=2, timeout=60) == [
        (0, 3, 2), (1, 3, 2), (2, 3, 2)]


def test_a_dead_rank_surfaces_at_once_without_a_timeout():
    assert inspect.signature(spawn).parameters["timeout"].default is None  # torch has none
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match="rank 1 exited with 1") as info:
        spawn(_fail_on_rank1, nprocs=2, grace=1.0)
    assert time.monotonic() - t0 < 50  # rank 0 sleeps 60 s: it was stopped, not awaited
    assert "boom on purpose" in str(info.value) and "boom on purpose" in info.value.stderr[1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="nprocs must be a positive int, got 0"):
        spawn(_env_of_rank, nprocs=0)
    with pytest.raises(ValueError, match="must be picklable"):
        spawn(lambda: 1, nprocs=1)
    with pytest.raises(ValueError, match="timeout must be None"):
        spawn(_env_of_rank, nprocs=1, timeout=-1)
    with pytest.raises(ValueError, match=r"spawn\(join=False\) is not supported"):
        spawn(_env_of_rank, nprocs=1, join=False)


_MAIN = """\
    import os, sys, time
    import jdist.launch

    class Config:  # an argument whose class lives in __main__ too
        def __init__(self, n):
            self.n = n

    def run(rank, cfg):
        print(f"hello from {rank} of {cfg.n}, argv={sys.argv[1:]}")
        print(f"to stderr {rank}", file=sys.stderr)
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT"]
        return [os.environ[k] for k in keys] + [len(os.environ["JDIST_RUN_ID"]) >= 16]

    if __name__ == "__main__":  # not run again in the children
        print("RESULT", jdist.launch.spawn(run, args=(Config(2),), nprocs=2, pass_rank=True))
"""


def _child_env():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_a_function_of_the_main_script_with_argv_output_and_torchrun_env(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_MAIN))
    res = subprocess.run([sys.executable, str(script), "--epochs", "3"], env=_child_env(),
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    want = [[str(r), str(r), "2", str(r), "2", "1", "0", True] for r in range(2)]
    assert f"RESULT {want}" in res.stdout
    for r in range(2):
        assert f"[rank {r}] hello from {r} of 2, argv=['--epochs', '3']" in res.stdout
        assert f"[rank {r}] to stderr {r}" in res.stderr
    assert res.stdout.count("RESULT") == 1


_ORPHANS = """\
    import os, subprocess, sys, time
    import jdist.launch

    def sit(out):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        path = os.path.join(out, "pids" + os.environ["RANK"])
        with open(path + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        os.replace(path + ".tmp", path)  # the test never reads half a file
        time.sleep(120)

    if __name__ == "__main__":
        jdist.launch.spawn(sit, args=(sys.argv[1],), nprocs=2)
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_ORPHANS))
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=_child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    files = [tmp_path / "pids0", tmp_path / "pids1"]
    deadline = time.monotonic() + 60
    while not all(f.exists() and len(f.read_text().split()) == 2 for f in files):
        assert time.monotonic() < deadline and parent.poll() is None, parent.stderr.read()
        time.sleep(0.05)
    pids = [int(p) for f in files for p in f.read_text().split()]
    assert all(_alive(p) for p in pids)
    return parent, pids


def _gone(pids, within):
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_a_sigtermed_parent_leaves_no_process_behind(tmp_path):
    parent, pids = _start_parent(tmp_path)
    parent.send_signal(signal.SIGTERM)
    parent.communicate(timeout=30)
    assert parent.returncode == -signal.SIGTERM  # it still dies of the signal
    assert not _gone(pids, 5)  # the ranks and what they started


def test_a_sigkilled_parent_takes_its_ranks_with_it(tmp_path):
    parent, pids = _start_parent(tmp_path)
    ranks = pids[0::2]  # (rank pid, its child pid) per file
    parent.kill()  # no handler runs: the children notice by themselves
    parent.communicate(timeout=30)
    assert not _gone(ranks, 5)
    for p in pids[1::2]:  # the ranks' own children are theirs to end; tidy up
        if _alive(p):
            os.kill(p, signal.SIGKILL)
