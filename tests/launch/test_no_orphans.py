"""A SIGKILLed launcher (``jdist-run``, or a ``spawn`` parent) leaves no process behind:
not its workers, and not what they started (issue 41, item 3).

Each worker starts one of every kind of descendant a training program makes: a child
in its own process group (a data-loader worker, ``subprocess.run``), a child in a
session of its own (``start_new_session=True``, a daemon), and a child that starts a
grandchild. Before the keeper (``jdist/launch/_keeper.py``), the workers died with the
launcher (their parent-death signal) and all of these lived on with PPID 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import process_alive

ROOT = str(Path(__file__).resolve().parents[2])

_FAMILY = """\
    import os, subprocess, sys, time

    def start_family(out, rank):
        sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
        kids = [subprocess.Popen(sleep), subprocess.Popen(sleep, start_new_session=True)]
        chain = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen("
             "[sys.executable, '-c', 'import time; time.sleep(120)']); "
             "print(p.pid, flush=True); time.sleep(120)"], stdout=subprocess.PIPE)
        pids = [os.getpid()] + [k.pid for k in kids] + [chain.pid,
                                                         int(chain.stdout.readline())]
        path = os.path.join(out, f"pids{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(" ".join(map(str, pids)))
        os.replace(path + ".tmp", path)
        time.sleep(120)
"""

_JDIST_RUN_WORKER = _FAMILY + """\

    start_family(sys.argv[1], os.environ["RANK"])
"""

_SPAWN_PARENT = _FAMILY + """\

    import jdist.launch

    def rank_main(out):
        start_family(out, os.environ["RANK"])

    if __name__ == "__main__":
        jdist.launch.spawn(rank_main, args=(sys.argv[1],), nprocs=2,
                           start_method=sys.argv[2])
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env



def _family_pids(tmp_path, parent):
    files = [tmp_path / "pids0", tmp_path / "pids1"]
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in files):
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()
            pytest.fail("the workers never started their children: "
                        + parent.communicate()[1][-3000:])
        time.sleep(0.05)
    pids = [int(p) for f in files for p in f.read_text().split()]
    assert len(pids) == 10 and all(process_alive(p) for p in pids)
    # the keeper finds descendants that left the worker's session by scanning every
    # 0.5 s: one started in the last half second before the launcher died may escape
    time.sleep(1.2)
    return pids


def _kill_and_count_survivors(parent, pids):
    parent.kill()  # no handler runs, nothing is closed in order
    parent.communicate(timeout=30)
    deadline = time.monotonic() + 5
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if process_alive(p)]
    for p in survivors:  # tidy up before failing
        os.kill(p, signal.SIGKILL)
    return survivors


def test_a_sigkilled_jdist_run_leaves_no_descendant(tmp_path, start_method):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(_JDIST_RUN_WORKER))
    launcher = subprocess.Popen([sys.executable, "-m", "jdist.launch", "--nproc-per-node",
                                 "2", str(script), str(tmp_path)], env=_env(), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = _family_pids(tmp_path, launcher)
    assert _kill_and_count_survivors(launcher, pids) == []


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_sigkilled_spawn_parent_leaves_no_descendant(tmp_path, method):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_SPAWN_PARENT))
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path), method],
                              env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    pids = _family_pids(tmp_path, parent)
    assert _kill_and_count_survivors(parent, pids) == []


def test_the_keeper_exits_when_its_launcher_ends():
    """A launcher that ends normally leaves no keeper behind either."""
    code = textwrap.dedent("""\
        import subprocess, sys, time
        from jdist.launch import _keeper
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
        _keeper.watch(p.pid)
        p.kill(); p.wait()
        _keeper.forget(p.pid)
        print(_keeper._keeper.pid, flush=True)
    """)
    res = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    keeper = int(res.stdout.split()[0])
    deadline = time.monotonic() + 5
    while process_alive(keeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(keeper)
