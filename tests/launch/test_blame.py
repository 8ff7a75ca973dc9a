"""jdist-run's failure summary names the rank that failed FIRST, by time, with its Python
traceback: not the rank whose exit the launcher happened to notice first.

The scripts mimic a collective job without JAX (a launch costs about a second): every
rank connects to rank 0's tiny server and blocks on it (the "barrier"). The failing rank
k then fails while the others block; once they notice (the connection drops) they die
as XLA kills a task whose peer is gone, by SIGABRT, or raise a peer-lost error. The
failing rank, as JAX's does, takes a while to shut down after its exception (its
``atexit``), so its exit comes last: the old summary blamed a consequence.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jdist.launch import _blame as blame
from jdist.launch import free_port

ROOT = str(Path(__file__).resolve().parents[2])

_JOB = """\
    import atexit, os, signal, socket, sys, time
    rank, k, how = int(os.environ["RANK"]), int(sys.argv[1]), sys.argv[2]
    port, n = int(sys.argv[3]), int(os.environ["WORLD_SIZE"])
    if rank == 0:  # the "store": hold every connection, close them all when it ends
        srv = socket.create_server(("127.0.0.1", port))
        srv.listen(n)
        conns = [srv.accept()[0] for _ in range(n - 1)]
    else:
        for _ in range(200):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.05)

    def stop_serving():  # rank 0's runtime stops serving its peers as it shuts down
        for c in conns:
            c.close()

    def fail():
        atexit.register(time.sleep, 3)  # a slow runtime shutdown: it exits last
        atexit.register(stop_serving if rank == 0 else conn.close)  # runs first
        if how == "raise":
            raise ValueError(f"boom-{rank}")
        if how == "abort":
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == k:
        time.sleep(0.2)
        fail()
    elif rank == 0:
        import selectors
        sel = selectors.DefaultSelector()
        for c in conns:
            sel.register(c, selectors.EVENT_READ)
        sel.select()  # a peer went away
        time.sleep(0.3)  # while it, maybe, still shuts down
        raise ConnectionError("lost a peer in the barrier")
    else:
        conn.recv(1)  # blocks in the barrier until rank 0 goes
        time.sleep(0.3)
        if rank % 2:  # the peers die as a runtime kills them, or raise
            os.abort()
        raise ConnectionError("lost rank 0 in the barrier")
"""


def _launch(tmp_path, k, how, start="spawn", nproc=3):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_JOB))
    env = dict(os.environ, JDIST_START_METHOD=start, JDIST_FORKSERVER_PRELOAD="json")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("JDIST_AUTH_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "jdist.launch", "--nproc-per-node", str(nproc),
         "--shutdown-timeout", "1", str(script), str(k), how, str(free_port())],
        env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("k,how,start", [
    (0, "raise", "spawn"), (1, "raise", "forkserver"), (2, "raise", "spawn"),
    (2, "sigkill", "spawn"), (0, "abort", "spawn"),
])
def test_the_summary_names_the_first_rank_to_fail(tmp_path, k, how, start):
    """Grid: rank k fails first by raising (rank 0, or a non-zero rank), by a fatal
    signal (faulthandler's time), or by SIGKILL (no record: its last moment alive); the
    others fail after it. The summary names rank k, with its traceback. Both start
    methods run the worker shim that records the failure."""
    res = _launch(tmp_path, k, how, start)
    summary = res.stderr.split("jdist-run: job failed: ", 1)[-1]
    assert re.match(rf"rank {k} \(node 0, local rank {k}\) ", summary), res.stderr
    if how == "raise":
        assert summary.startswith(f"rank {k} (node 0, local rank {k}) raised ValueError: "
                                  f"boom-{k} on attempt 1 of 1"), summary
        assert "Its Python traceback:\n    Traceback (most recent call last):" in summary
        assert 'job.py", line ' in summary and f"\n    ValueError: boom-{k}\n" in summary
        assert "_run_script" not in summary and "runpy" not in summary  # the shim's frames
        assert res.returncode == 1
    elif how == "abort":
        assert "was killed by signal SIGABRT" in summary.splitlines()[0]
        assert "Its Python traceback:" in summary and "in fail" in summary
        assert res.returncode == 128 + 6
    else:
        assert "was killed by signal SIGKILL" in summary.splitlines()[0]
        assert res.returncode == 128 + 9
    # what had failed too when the launcher decided: consequences, never rank k
    later = summary.partition("Failed after it (consequences, in time order): ")[2]
    assert {int(x) for x in re.findall(r"(?:^|; )rank (\d+) ", later)} <= {0, 1, 2} - {k}
    if how == "raise":  # the exit that made the launcher look was a consequence
        assert later, summary


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_nodes_reporting_in_any_order_keep_the_earliest_failure(order):
    """Several launchers report their node's first failure to one key (a compare_set
    loop): whatever the order of the reports, the earliest by time stays, and every
    launcher reads that one."""
    from jdist.launch._agent import _report_earliest
    from jdist.launch._worker_group import Failure
    from jdist.store import HashStore

    store = HashStore()
    times = {0: 10.5, 1: 10.2, 2: 11.0}  # node 1's rank raised first
    kept = [_report_earliest(store, "failed", Failure(
        4 * node, 0, node, 1, f"raised E{node}", "", 0, times[node])) for node in order]
    first = next(i for i, node in enumerate(order) if node == 1)
    assert [k.node_rank for k in kept[first:]] == [1] * (len(order) - first)
    assert _report_earliest(store, "failed", None).rank == 4


@pytest.mark.parametrize("peer_first", [True, False])
def test_a_peer_failed_error_is_a_consequence_not_the_cause(peer_first):
    """A rank that raised PeerFailedError (its peer died) is listed after the rank that
    died, even when the launcher saw the dead rank running last after that error."""
    dead = blame.Candidate(10.2 if peer_first else 10.0, 1, "was killed by signal SIGTERM",
                           "", None)
    peer = blame.Candidate(10.1, 0, "raised jdist.errors.PeerFailedError: all_reduce on "
                           "group 'WORLD' failed because a peer died: rank 1 is gone",
                           "tb", 1, "jdist.errors.PeerFailedError")
    other = blame.Candidate(10.3, 2, "raised ValueError: boom", "tb", 1, "ValueError")
    first, rest = blame.first_failure([peer, dead, other])
    assert first is dead
    assert rest == [other, peer]
