"""``JDIST_XLA_CPU_THREADS`` sizes XLA's CPU thread pool (``jdist/_xla_threads.py``).

XLA sizes the pool from the creating thread's CPU set, and never below the number of
the process's CPU devices (each may need a thread for an in-process collective); the
count of its threads (named ``tf_XLAEigen`` by XLA) is the independent reference.
Checked over a grid of values and device counts in fresh interpreters (hooked before
``import jax``, and after it), in
``jdist.launch.spawn``'s ranks and ``jdist-run``'s workers (several processes on a node
get 1), and with no thread left pinned: every thread keeps the process's CPU set.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

from jdist._xla_threads import parse_threads
from jdist.launch._env import JobInfo, worker_env, xla_threads
from tests.helpers import run_procs

CORES = len(os.sched_getaffinity(0))

# what a process reports once JAX's CPU client exists
_REPORT = textwrap.dedent("""
    import json, os
    import jax.numpy as jnp
    jnp.ones(3).block_until_ready()
    tasks = os.listdir("/proc/self/task")
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    masks = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks}
    print("REPORT" + json.dumps({"eigen": names.count("tf_XLAEigen"),
                                 "masks": sorted(masks)}))
""")


def _report_here() -> dict:
    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(_REPORT, ns)
    return json.loads(out.getvalue().split("REPORT", 1)[1])


def _fresh(value: str | None, jax_first: bool, devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JDIST_XLA_CPU_THREADS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if value is not None:
        env["JDIST_XLA_CPU_THREADS"] = value
    head = "import jax\n" if jax_first else ""
    code = head + "from jdist._xla_threads import limit_from_env\nlimit_from_env()\n" + _REPORT
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.split("REPORT", 1)[1])


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("jax_first", [False, True])
@pytest.mark.parametrize("value", [None, "1", "2", str(CORES + 3)])
def test_the_pool_has_the_threads_asked_and_no_thread_is_pinned(value, jax_first, devices):
    got = _fresh(value, jax_first, devices)
    want = CORES if value is None else min(int(value), CORES)
    assert got["eigen"] == max(want, devices)
    assert got["masks"] == [sorted(os.sched_getaffinity(0))]


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_a_bad_value_is_refused_naming_the_variable(bad):
    with pytest.raises(ValueError, match=f"JDIST_XLA_CPU_THREADS='{bad}'"):
        parse_threads({"JDIST_XLA_CPU_THREADS": bad})
    assert parse_threads({}) is None and parse_threads({"JDIST_XLA_CPU_THREADS": " "}) is None


def test_after_jax_made_its_client_it_warns_and_changes_nothing():
    code = ("import warnings, jax.numpy as jnp\njnp.ones(1).block_until_ready()\n"
            "from jdist._xla_threads import limit_cpu_threads\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n    limit_cpu_threads(1)\n"
            "print('WARN', [str(x.message) for x in w])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "came after JAX made its CPU client" in out.stdout


def _rank_report():
    return _report_here()


def test_spawned_ranks_get_their_share_and_an_explicit_value_wins():
    share = min(xla_threads(2), CORES)
    for got in run_procs(_rank_report, 2):
        assert got["eigen"] == share
        assert got["masks"] == [sorted(os.sched_getaffinity(0))]
    for got in run_procs(_rank_report, 2, env={"JDIST_XLA_CPU_THREADS": "1"}):
        assert got["eigen"] == 1


def test_jdist_run_workers_get_one_thread_each_when_asked(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(_REPORT)
    out = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                          "--devices-per-proc", "1", str(script)], capture_output=True,
                         text=True, timeout=180, cwd=tmp_path,
                         env={**os.environ, "JDIST_XLA_CPU_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    reports = [json.loads(line.split("REPORT", 1)[1]) for line in out.stdout.splitlines()
               if "REPORT" in line]
    assert len(reports) == 2 and all(r["eigen"] == 1 for r in reports), out.stdout


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("local", [1, 2, 3, 8])
def test_worker_env_gives_each_process_its_share_of_cores_at_least_two(cores, local):
    job = JobInfo(world_size=local, rank_offset=0, nnodes=1, node_rank=0,
                  local_world_size=local, master_addr="127.0.0.1", master_port=1,
                  token="t", run_id="r", restart_count=0, max_restarts=0)
    env = worker_env({}, job, 0, None, cores=cores)
    if local == 1:
        assert "JDIST_XLA_CPU_THREADS" not in env
    else:
        assert env["JDIST_XLA_CPU_THREADS"] == str(max(2, cores // local))
        assert int(env["JDIST_XLA_CPU_THREADS"]) * local <= max(cores, 2 * local)
