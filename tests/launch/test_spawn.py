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
from tests.helpers import process_alive, run_procs

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
        print("RESULT", jdist.launch.spawn(run, args=(Config(2),), nprocs=2, pass_rank=True,
                                           start_method="METHOD"))
"""


def _child_env():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_function_of_the_main_script_with_argv_output_and_torchrun_env(tmp_path, method):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_MAIN).replace("METHOD", method))
    res = subprocess.run([sys.executable, str(script), "--epochs", "3"], env=_child_env(),
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    want = [[str(r), str(r), "2", str(r), "2", "1", "0", True] for r in range(2)]
    assert f"RESULT {want}" in res.stdout
    for r in range(2):
        assert f"[rank {r}] hello from {r} of 2, argv=['--epochs', '3']" in res.stdout
        assert f"[rank {r}] to stderr {r}" in res.stderr
    assert res.stdout.count("RESULT") == 1
    # nothing but the user's own output: runpy warned in every child while the package
    # imported the module the children run
    assert "Warning" not in res.stderr, res.stderr


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
        jdist.launch.spawn(sit, args=(sys.argv[1],), nprocs=2, start_method=sys.argv[2])
"""



def _start_parent(tmp_path, method):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_ORPHANS))
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path), method],
                              env=_child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    files = [tmp_path / "pids0", tmp_path / "pids1"]
    deadline = time.monotonic() + 60
    while not all(f.exists() and len(f.read_text().split()) == 2 for f in files):
        assert time.monotonic() < deadline and parent.poll() is None, parent.stderr.read()
        time.sleep(0.05)
    pids = [int(p) for f in files for p in f.read_text().split()]
    assert all(process_alive(p) for p in pids)
    return parent, pids


def _gone(pids, within):
    deadline = time.monotonic() + within
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if process_alive(p)]


METHODS = pytest.mark.parametrize("method", ["spawn", "forkserver"])


@METHODS
def test_a_sigtermed_parent_leaves_no_process_behind(tmp_path, method):
    parent, pids = _start_parent(tmp_path, method)
    parent.send_signal(signal.SIGTERM)
    parent.communicate(timeout=30)
    assert parent.returncode == -signal.SIGTERM  # it still dies of the signal
    assert not _gone(pids, 5)  # the ranks and what they started


@METHODS
def test_a_sigkilled_parent_takes_its_ranks_with_it(tmp_path, method):
    parent, pids = _start_parent(tmp_path, method)
    parent.kill()  # no handler runs: the ranks notice, the keeper takes their children
    parent.communicate(timeout=30)
    assert not _gone(pids, 5)  # (rank pid, its child pid) per file


def _rank_facts():
    import jax
    import numpy as np

    return {"rank": int(os.environ["RANK"]), "devices": len(jax.devices()),
            "draw": float(np.random.rand()), "pid": os.getpid(), "ppid": os.getppid(),
            "session": os.getsid(0), "cwd": os.getcwd()}


def test_forkserver_ranks_are_separate_processes_with_their_own_environment(tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = spawn(_rank_facts, nprocs=2, devices_per_proc=3, timeout=120,
                  start_method="forkserver")
    again = spawn(_rank_facts, nprocs=3, devices_per_proc=1, timeout=120,
                  start_method="forkserver")
    assert [r["rank"] for r in first] == [0, 1] and [r["rank"] for r in again] == [0, 1, 2]
    assert {r["devices"] for r in first} == {3} and {r["devices"] for r in again} == {1}
    server = first[0]["ppid"]  # one server, reused by the second run
    assert all(r["ppid"] == server != os.getpid() for r in first + again)
    assert all(r["session"] == r["pid"] for r in first + again)  # own session each
    assert len({r["pid"] for r in first + again}) == 5
    assert len({r["draw"] for r in first + again}) == 5  # numpy reseeded in each rank
    assert {r["cwd"] for r in first + again} == {str(tmp_path)}


def test_forkserver_failures_surface_like_spawn():
    with pytest.raises(SpawnError, match="rank 1 exited with 1") as info:
        spawn(_fail_on_rank1, nprocs=2, grace=1.0, start_method="forkserver")
    assert "boom on purpose" in info.value.stderr[1]
    with pytest.raises(ValueError, match="start_method='thread'.*'forkserver'"):
        spawn(_env_of_rank, nprocs=1, start_method="thread")


def test_forkserver_refuses_a_preload_that_starts_jax(tmp_path, monkeypatch):
    from jdist.launch import _forkserver, set_forkserver_preload

    (tmp_path / "starts_jax.py").write_text("import jax.numpy as jnp\nX = jnp.ones(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_forkserver, "_preload", _forkserver._preload)  # restored after
    set_forkserver_preload(["starts_jax"])
    with pytest.raises(RuntimeError, match=r"preloading \['starts_jax'\] initialized a "
                                           r"JAX backend"):
        spawn(_env_of_rank, nprocs=1, timeout=60, start_method="forkserver")
    with pytest.raises(ValueError, match="non-empty strings, got \\[''\\]"):
        set_forkserver_preload([""])


def test_a_closed_fork_server_sees_the_end_and_exits_by_itself():
    from jdist.launch import _forkserver

    server = _forkserver._Server(dict(os.environ), ("json",))
    assert server.alive()
    server.close()  # the reader thread is blocked in recv on the same socket meanwhile
    assert server.proc.returncode == 0  # it saw EOF; it was not killed after a wait
