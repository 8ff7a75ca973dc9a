"""The worker program of tests/launch/test_torch_agent.py (run by jdist-run).

``python torch_agent_worker.py CASE OUT [ARG]``: every case first writes what the worker
saw (its environment, pid) to ``OUT/a<restart count>_r<rank>.json``, then does what
torch's elastic-agent test functions do (``_happy_function``, ``_sad_function``,
``_bipolar_function``, ``_dist_sum``, ``_sleep``, ...). Only the ``dist_sum`` case
imports JAX.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

KEYS = ["RANK", "LOCAL_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_RANK", "LOCAL_WORLD_SIZE",
        "ROLE_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
        "JDIST_RESTART_COUNT",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCHELASTIC_ERROR_FILE", "JDIST_ERROR_FILE", "TORCHELASTIC_TIMER_FILE",
        "TORCHELASTIC_HEALTH_CHECK_PORT"]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
ATTEMPT = int(os.environ["JDIST_RESTART_COUNT"])  # the attempt (torch's count: restarts spent)


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def report(out: str, **extra) -> None:
    data = {"env": {k: os.environ.get(k) for k in KEYS}, "pid": os.getpid(),
            "time": time.time(), **extra}
    _write(os.path.join(out, f"a{ATTEMPT}_r{RANK}.json"), data)


def _sad_function():
    raise RuntimeError("sad because i throw")


def _wait_for(path: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _echo(msg):
    return msg


def dist_sum(out: str, rpc_too: str = "") -> None:
    """torch's ``_dist_sum`` (and, with ``rpc``, its ``rpc_master``/``rpc_worker``)."""
    import numpy as np

    import jdist

    jdist.init_process_group(backend="gloo")
    total = int(jdist.all_reduce(np.array(RANK), op=jdist.ReduceOp.SUM))
    if total != sum(range(WORLD)):
        raise RuntimeError(f"Expected rank sum {sum(range(WORLD))}, got {total}")
    reply = None
    if rpc_too:
        import jdist.rpc as rpc

        rpc.init_rpc("master" if RANK == 0 else f"worker{RANK}", rank=RANK, world_size=WORLD)
        if RANK == 0:
            reply = f"{rpc.rpc_sync('worker1', _echo, args=('hello world',))} from worker"
        rpc.shutdown()
    report(out, sum=total, rpc=reply)


def store_sum(out: str) -> None:
    """The ranks' sum through a store at the job's MASTER_ADDR:MASTER_PORT (rank 0
    hosts it), as a process group's rendezvous would."""
    from jdist.store import TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                     is_master=RANK == 0, wait_for_workers=False, timeout=60.0,
                     auth_token=os.environ.get("JDIST_AUTH_TOKEN"))
    store.add("sum", RANK)
    store.add("joined", 1)
    deadline = time.monotonic() + 60
    while store.add("joined", 0) < WORLD and time.monotonic() < deadline:
        time.sleep(0.02)
    total = store.add("sum", 0)
    store.add("read", 1)
    while RANK == 0 and store.add("read", 0) < WORLD and time.monotonic() < deadline:
        time.sleep(0.02)  # the host stays until every rank has read
    print(f"sum {total}")
    report(out, sum=total)


def main(case: str, out: str, arg: str = "") -> None:
    if case == "dist_sum":
        return dist_sum(out, arg)
    if case == "store_sum":
        return store_sum(out)
    if case == "scaled_work":  # torch's scaled_work: wait for the scale event, then sum
        if WORLD == int(arg):
            report(out)
            time.sleep(60)
        return store_sum(out)
    report(out)
    if case == "env":  # and leave a grandchild behind: the launcher must end it
        child = subprocess.Popen(["sleep", "120"])
        report(out, grandchild=child.pid)
    elif case == "sad":
        _sad_function()
    elif case == "bipolar":
        if RANK % 2:
            _sad_function()
    elif case == "bipolar_sleep":
        if RANK % 2:
            _sad_function()
        time.sleep(float(arg))
    elif case == "fail_rank_one_once":
        if RANK == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        report(out, value=[[RANK] * 3] * 2)
    elif case == "sleep":
        time.sleep(float(arg))
        report(out, value=RANK)
    elif case == "sleep_first_attempt":
        if ATTEMPT == 0:
            time.sleep(float(arg))
    elif case == "sigterm":
        def on_term(signum, frame):
            _write(os.path.join(out, f"term_r{RANK}.json"), {"signal": signum})
            sys.exit(0)

        signal.signal(signal.SIGTERM, on_term)
        _write(os.path.join(out, f"ready_r{RANK}.json"), {})
        time.sleep(120)
    elif case == "grace":
        if RANK == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _write(os.path.join(out, "ready_r0.json"), {})
            time.sleep(120)
        _wait_for(os.path.join(out, "ready_r0.json"))
        _sad_function()
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
