"""torch's elastic-agent tests (test/distributed/elastic/agent/server/test/*), translated
to jdist-run: the worker environment as torch's agent sets it, ranks of one and of two
launchers, the error file, restarts and their budget, signals, the SIGTERM-to-SIGKILL
grace, failure propagation between nodes, and functions run by ``spawn`` with their
return values. Manifests: tests/conformance/elastic_agent_*.toml.

Every launch of the module starts at once in one fixture (tiny worker scripts,
tests/launch/torch_agent_worker.py; two launches import JAX for an all-reduce and RPC),
and each test reads the launch it needs.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from jdist.launch import free_port, spawn
from jdist.launch._config import parse_args

ROOT = str(Path(__file__).resolve().parents[2])
WORKER = str(Path(__file__).with_name("torch_agent_worker.py"))
TORCH_ENV_VARS = [  # torch's _check_env_function
    "RANK", "LOCAL_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_RANK", "LOCAL_WORLD_SIZE",
    "ROLE_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]
_TIMER_FILE = f"/tmp/watchdog_timer_{uuid.uuid4()}"
_PREFIX = "[${role_name}-${local_rank}:${rank}]:"  # torch's test_run_with_custom_log_lines
_DROP = ("JDIST_AUTH_TOKEN", "JDIST_START_METHOD", "JDIST_FORKSERVER_PRELOAD",
         "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
         "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_HEALTH_CHECK_PORT")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Launch:
    """One or more jdist-run launchers (one per node) of one case, started now."""

    def __init__(self, out: Path, case: str, flags: list[str], nodes=None, arg="",
                 env=None, script=None):
        self.out = out
        out.mkdir()
        self.case, self.flags, self.env, self.script = case, flags, env, script
        self.port = str(free_port())
        self.t0 = time.time()
        self.procs, self.threads = [], []
        self.results: dict[int, tuple[int, str, str, float]] = {}
        for node in nodes or [(None, None, arg)]:
            self.add(*node)

    def add(self, node_rank, nproc, arg):
        """Start one more launcher (``node_rank`` None: the case's flags alone)."""
        node_flags = [] if node_rank is None else [
            "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
            "--master-port", self.port]
        if node_rank == "joined":  # torchrun's c10d style: ranks in the order of joining
            node_flags = ["--rdzv-endpoint", f"127.0.0.1:{self.port}",
                          "--nproc-per-node", str(nproc)]
        tail = [self.script] if self.script else [WORKER, self.case, str(self.out), arg]
        proc = subprocess.Popen(
            [sys.executable, "-m", "jdist.launch", *self.flags, *node_flags, *tail],
            env=_env(**(self.env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        self.procs.append(proc)
        self.threads.append(threading.Thread(target=self._wait, args=(proc,), daemon=True))
        self.threads[-1].start()

    def _wait(self, proc):
        try:
            out, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        self.results[proc.pid] = (proc.returncode, out, err, time.time())

    def result(self, node: int = 0):
        """``(returncode, stdout, stderr, exit time)`` of the ``node``-th launcher."""
        for t in list(self.threads):
            t.join(160)
        return self.results[self.procs[node].pid]

    def reports(self) -> dict[tuple[int, int], dict]:
        """What each worker wrote: ``(attempt, rank) -> report``."""
        found = {}
        for path in glob.glob(str(self.out / "a*_r*.json")):
            a, r = re.fullmatch(r"a(\d+)_r(\d+)\.json", os.path.basename(path)).groups()
            found[int(a), int(r)] = json.loads(Path(path).read_text())
        return found


def _when_files(paths, then, seconds=90.0):
    """Call ``then()`` once every path exists (from a thread), or give up."""
    def watch():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(os.path.exists(p) for p in paths):
                then()
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_agent")
    two = ["--nnodes", "2"]
    j = {
        "env": Launch(tmp / "env", "env", [
            "--nproc-per-node", "8", "--max-restarts", "2", "--rdzv-id", "torch-agent-run",
            "--master-addr", "localhost"], env={
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCHELASTIC_TIMER_FILE": _TIMER_FILE,
            "TORCHELASTIC_HEALTH_CHECK_PORT": "12345"}),
        "sad": Launch(tmp / "sad", "sad", ["--nproc-per-node", "2"],
                      env={"TORCHELASTIC_ERROR_FILE": str(tmp / "error.json")}),
        "bipolar": Launch(tmp / "bipolar", "bipolar",
                          ["--nproc-per-node", "4", "--max-restarts", "2"]),
        "restart": Launch(tmp / "restart", "fail_rank_one_once",
                          ["--nproc-per-node", "2", "--max-restarts", "3"]),
        "sigterm": Launch(tmp / "sigterm", "sigterm", ["--nproc-per-node", "2"]),
        "grace": Launch(tmp / "grace", "grace",
                        ["--nproc-per-node", "2", "--shutdown-timeout", "1"]),
        "dist_sum": Launch(tmp / "dist_sum", "dist_sum", ["--nproc-per-node", "2"],
                           arg="rpc"),
        "hetero": Launch(tmp / "hetero", "dist_sum", two, nodes=[(0, 1, ""), (1, 2, "")]),
        "homo": Launch(tmp / "homo", "store_sum", two, nodes=[(0, 4, ""), (1, 4, "")],
                       env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": _PREFIX}),
        "no_barrier": Launch(tmp / "no_barrier", "bipolar_sleep", two,
                             nodes=[(0, 2, "20"), (1, 2, "20")]),
        "drift": Launch(tmp / "drift", "sleep", two, nodes=[(0, 1, "0"), (1, 1, "2")]),
        "elastic": Launch(tmp / "elastic", "sleep_first_attempt", [
            "--nnodes", "1:2", "--heartbeat-timeout", "3"],
            nodes=[(0, 2, "60"), (1, 2, "60")]),
        "scale_up": Launch(tmp / "scale_up", "scaled_work", [
            "--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "0"],
            nodes=[("joined", 1, "1")]),
        "missing": Launch(tmp / "missing", "", ["--nproc-per-node", "2"],
                          script=str(tmp / "no_such_script.py")),
    }
    sig = j["sigterm"]
    _when_files([sig.out / "ready_r0.json", sig.out / "ready_r1.json"],
                lambda: sig.procs[0].send_signal(signal.SIGTERM))
    el = j["elastic"]  # node 1's launcher dies once its workers run
    _when_files([el.out / "a0_r2.json", el.out / "a0_r3.json"],
                lambda: el.procs[1].send_signal(signal.SIGKILL))
    up = j["scale_up"]  # a second launcher once the first one's job runs
    _when_files([up.out / "a0_r0.json"], lambda: up.add("joined", 1, "1"))
    yield j
    for launch in j.values():
        for p in launch.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def _ok(launch, node=0):
    code, out, err, _ = launch.result(node)
    assert code == 0, f"exit {code}\n{out}\n{err}"


# --- the worker environment (local_elastic_agent_test, api_test) -------------------------
def test_check_env_function(jobs):
    """torch's ``_check_env_function``: every variable torch's agent sets is there."""
    _ok(jobs["env"])
    reports = jobs["env"].reports()
    assert len(reports) == 8
    for rep in reports.values():
        missing = [k for k in TORCH_ENV_VARS if rep["env"][k] is None]
        assert not missing, missing


def test_rendezvous_ranks_of_one_launcher(jobs):
    """api_test's ``test_rendezvous``: one agent of 8 workers: group rank 0 of 1, world
    size 8, global rank = 8 * group rank + local rank, ranks 0..7; roles: one."""
    _ok(jobs["env"])
    envs = [r["env"] for r in jobs["env"].reports().values()]
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"1"}
    assert {e["GROUP_RANK"] for e in envs} == {"0"}
    assert sorted(int(e["RANK"]) for e in envs) == list(range(8))
    for e in envs:
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == "8"
        assert e["RANK"] == e["LOCAL_RANK"] == e["ROLE_RANK"]
        assert e["ROLE_NAME"] == "default"
        assert int(e["MASTER_PORT"]) > 0


def test_master_addr_is_the_given_address(jobs):
    """``test_rendezvous_master_addr_with_local_addr`` / ``check_master_addr_port_override``:
    the workers' MASTER_ADDR is the address the launcher was given."""
    _ok(jobs["env"])
    assert {r["env"]["MASTER_ADDR"] for r in jobs["env"].reports().values()} == {"localhost"}


def test_default_master_addr_is_loopback(jobs):
    """Departure (``test_rendezvous_default_master_addr``): without --master-addr a
    one-node job's MASTER_ADDR is 127.0.0.1, not the host's FQDN."""
    jobs["bipolar"].result()
    assert {r["env"]["MASTER_ADDR"] for r in jobs["bipolar"].reports().values()} == {
        "127.0.0.1"}


def test_nccl_async_error_handling_env(jobs):
    """The launcher's TORCH_NCCL_ASYNC_ERROR_HANDLING=0 reaches the workers."""
    _ok(jobs["env"])
    assert {r["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            for r in jobs["env"].reports().values()} == {"0"}


def test_nccl_async_error_handling_env_default(jobs):
    """Unset in the launcher's environment, it is 1 (torch's agent's default)."""
    jobs["sad"].result()
    assert {r["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            for r in jobs["sad"].reports().values()} == {"1"}


def test_timer_file_and_health_check_port_pass_through(jobs):
    """Departure (watchdog / health-check setup): jdist-run starts no file-timer or
    health-check server; TORCHELASTIC_TIMER_FILE and TORCHELASTIC_HEALTH_CHECK_PORT
    reach the workers as the launcher's environment has them, and are absent without."""
    _ok(jobs["env"])
    for r in jobs["env"].reports().values():
        assert r["env"]["TORCHELASTIC_TIMER_FILE"] == _TIMER_FILE
        assert r["env"]["TORCHELASTIC_HEALTH_CHECK_PORT"] == "12345"
    jobs["sad"].result()
    for r in jobs["sad"].reports().values():
        assert r["env"]["TORCHELASTIC_TIMER_FILE"] is None
        assert r["env"]["TORCHELASTIC_HEALTH_CHECK_PORT"] is None


def test_run_happy_path_spends_no_restart(jobs):
    """``test_run_happy_path`` / ``test_agent_constructor``: workers that succeed run
    once, with the whole budget: restart count 0 of --max-restarts; the run id is
    --rdzv-id; the workers do not use the launchers' store."""
    _ok(jobs["env"])
    reports = jobs["env"].reports()
    assert {a for a, _ in reports} == {0}
    for r in reports.values():
        assert r["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert r["env"]["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert r["env"]["TORCHELASTIC_RUN_ID"] == "torch-agent-run"
        assert r["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def _gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_shutdown_called(jobs):
    """``shutdown_called``: after the workers succeeded, the launcher still ends what
    they left running (their process groups), as torch's agent closes its context."""
    _ok(jobs["env"])
    pids = [r["grandchild"] for r in jobs["env"].reports().values()]
    assert len(pids) == 8
    assert all(_gone(pid) for pid in pids)


# --- failures, the error file, restarts --------------------------------------------------
def test_run_sad_function(jobs):
    """``run_sad_function``: both ranks raise; the launcher exits 1, names a rank in {0, 1},
    and copies its record to the launcher's TORCHELASTIC_ERROR_FILE in torch's shape."""
    launch = jobs["sad"]
    code, _, err, end = launch.result()
    assert code == 1, err
    m = re.search(r"job failed: rank (\d) \(node 0, local rank (\d)\) raised RuntimeError: "
                  r"sad because i throw", err)
    assert m and m.group(1) in "01" and m.group(1) == m.group(2), err
    data = json.loads((launch.out.parent / "error.json").read_text())["message"]
    assert data["message"] == "RuntimeError: sad because i throw"
    assert data["errorCode"] == 1
    assert int(launch.t0) - 1 <= int(data["extraInfo"]["timestamp"]) <= end + 1
    assert 'raise RuntimeError("sad because i throw")' in data["extraInfo"]["py_callstack"]
    reports = launch.reports()  # (a rank may be stopped before it wrote its report)
    files = {r["env"]["TORCHELASTIC_ERROR_FILE"] for r in reports.values()}
    assert len(files) == len(reports) >= 1  # one file per rank
    assert str(launch.out.parent / "error.json") not in files
    assert all(r["env"]["JDIST_ERROR_FILE"] == r["env"]["TORCHELASTIC_ERROR_FILE"]
               for r in reports.values())


def test_run_bipolar_function(jobs):
    """``run_bipolar_function`` / ``test_run_max_retries_exceeded``: odd ranks raise on
    every attempt: the job runs 1 + max_restarts attempts, then fails with no restarts
    left."""
    code, _, err, _ = jobs["bipolar"].result()
    assert code == 1, err
    assert "on attempt 3 of 3; no restarts left (--max-restarts 2)" in err, err
    assert "raised RuntimeError: sad because i throw" in err
    assert err.count("restarting the job") == 2


def test_restart_workers(jobs):
    """``test_restart_workers``: each attempt starts every worker anew (new processes,
    the attempt's restart count). (A rank may be stopped by its peer's failure before it
    got to write its report.)"""
    jobs["bipolar"].result()
    reports = jobs["bipolar"].reports()
    assert {a for a, _ in reports} == {0, 1, 2} and {r for _, r in reports} <= set(range(4))
    assert len({r["pid"] for r in reports.values()}) == len(reports)
    for (a, _), r in reports.items():
        assert r["env"]["TORCHELASTIC_RESTART_COUNT"] == str(a)


def test_rank_restart_after_failure(jobs):
    """``test_rank_restart_after_failure``: rank 1 is SIGKILLed on the first attempt;
    with --max-restarts 3 the job restarts and succeeds, every rank returning its value."""
    launch = jobs["restart"]
    code, _, err, _ = launch.result()
    assert code == 0, err
    assert "rank 1 was killed by signal SIGKILL; restarting the job" in err
    reports = launch.reports()
    for rank in (0, 1):
        assert reports[1, rank]["value"] == [[rank] * 3] * 2


def test_agent_process_signal_exception(jobs):
    """``test_agent_process_signal_exception``: SIGTERM to the launcher reaches every
    worker as SIGTERM; the launcher exits 128 + SIGTERM."""
    launch = jobs["sigterm"]
    code, _, err, _ = launch.result()
    assert code == 128 + signal.SIGTERM, err
    assert "got SIGTERM; stopped every worker" in err
    for rank in (0, 1):
        data = json.loads((launch.out / f"term_r{rank}.json").read_text())
        assert data["signal"] == signal.SIGTERM


def test_shutdown_method_receives_correct_timeout(jobs):
    """``test_shutdown_method_receives_correct_timeout``: stopping the workers sends
    SIGTERM and, after --shutdown-timeout (1 s), SIGKILL: a worker that ignores SIGTERM
    does not hold the launcher for its 120 s."""
    code, _, err, end = jobs["grace"].result()
    assert code == 1, err
    assert "rank 1 (node 0, local rank 1) raised RuntimeError" in err
    assert end < jobs["grace"].reports()[0, 0]["time"] + 60, err


def test_run_initialization_failure(jobs):
    """``test_run_initialization_failure``: a job that cannot start fails before any
    worker runs (here: the script is missing; exit 2 as a usage error)."""
    code, _, err, _ = jobs["missing"].result()
    assert code == 2 and "not found" in err, err
    assert not jobs["missing"].reports()


# --- jobs of several launchers, and collectives -------------------------------------------
def test_simple_dist_sum_and_torch_rpc(jobs):
    """``simple_dist_sum``: the workers' process group sums their ranks; ``torch_rpc``:
    rank 0 calls rank 1 over RPC."""
    _ok(jobs["dist_sum"])
    reports = jobs["dist_sum"].reports()
    assert {k: r["sum"] for k, r in reports.items()} == {(0, 0): 1, (0, 1): 1}
    assert reports[0, 0]["rpc"] == "hello world from worker"


def test_run_distributed_sum_heterogeneous(jobs):
    """``run_distributed_sum_heterogeneous`` / ``multiple_agent_dist_sum``: two launchers
    of 1 and 2 workers form one job of ranks 0..2 whose all-reduce (jdist's process
    group) sums every rank; each launcher's workers hold consecutive ranks. (torch runs
    3 agents of 1, 2, 3 and 2 of 4 workers; 3 JAX processes keep the suite's budget.)"""
    launch = jobs["hetero"]
    _ok(launch, 0)
    _ok(launch, 1)
    envs = {rank: r["env"] for (_, rank), r in launch.reports().items()}
    assert {r["sum"] for r in launch.reports().values()} == {0 + 1 + 2}
    assert sorted(envs) == [0, 1, 2]
    assert [envs[r]["GROUP_RANK"] for r in range(3)] == ["0", "1", "1"]
    assert [envs[r]["LOCAL_WORLD_SIZE"] for r in range(3)] == ["1", "2", "2"]
    assert [envs[r]["LOCAL_RANK"] for r in range(3)] == ["0", "0", "1"]
    for r in range(3):
        assert envs[r]["WORLD_SIZE"] == envs[r]["ROLE_WORLD_SIZE"] == "3"
        assert envs[r]["GROUP_WORLD_SIZE"] == "2" and envs[r]["ROLE_RANK"] == str(r)


def test_run_distributed_sum_homogeneous(jobs):
    """``run_distributed_sum_homogeneous``: two launchers of 4 workers: ranks 0..7, node 0
    holding 0..3, and the ranks' sum through a store at the job's MASTER_ADDR:MASTER_PORT
    (rank 0 hosts it, as a process group's rendezvous does; 8 JAX processes would cost
    the suite too much: the all-reduce across launchers is the heterogeneous test's)."""
    launch = jobs["homo"]
    _ok(launch, 0)
    _ok(launch, 1)
    reports = launch.reports()
    assert sorted(rank for _, rank in reports) == list(range(8))
    assert {r["sum"] for r in reports.values()} == {sum(range(8))}
    for (_, rank), r in reports.items():
        assert r["env"]["GROUP_RANK"] == str(rank // 4)
        assert r["env"]["LOCAL_RANK"] == str(rank % 4)


def test_run_with_custom_log_lines(jobs):
    """``test_run_with_custom_log_lines``: the homogeneous job with torch's
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: each launcher's console lines carry the
    template's role name, local rank and rank instead of ``[rank N]``."""
    launch = jobs["homo"]
    for node in (0, 1):
        code, out, err, _ = launch.result(node)
        assert code == 0, err
        lines = sorted(line for line in out.splitlines() if "sum" in line)
        assert lines == [f"[default-{lr}:{4 * node + lr}]:sum 28" for lr in range(4)], out
        assert "[rank " not in out


def test_no_exit_barrier_on_failure(jobs):
    """``test_no_exit_barrier_on_failure``: odd ranks fail at once on both nodes while
    even ranks would sleep 20 s: both launchers exit non-zero at once, close together."""
    launch = jobs["no_barrier"]
    results = [launch.result(n) for n in (0, 1)]
    assert all(code not in (0, None) for code, *_ in results), results
    ends = [end for *_, end in results]
    slept = [r["time"] for (_, rank), r in launch.reports().items() if rank % 2 == 0]
    assert max(ends) < min(slept, default=launch.t0) + 15, results  # not after their 20 s
    assert abs(ends[0] - ends[1]) < 5, results


def test_workers_drift_success(jobs):
    """``workers_drift_success`` / ``workers_drift_fail``: one node's worker ends 2 s
    after the other's; both succeed (returning their rank), and node 0's launcher
    waits for node 1's workers before it exits."""
    launch = jobs["drift"]
    _ok(launch, 0)
    _ok(launch, 1)
    reports = launch.reports()
    assert {rank: r["value"] for (_, rank), r in reports.items()} == {0: 0, 1: 1}
    assert launch.result(0)[3] >= reports[0, 1]["time"]


def test_double_agent_elastic(jobs):
    """``double_agent_elastic``: of two launchers of a --nnodes 1:2 job, node 1's is
    SIGKILLed while its workers run; node 0 goes on alone (a new attempt of its 2
    workers) and succeeds."""
    launch = jobs["elastic"]
    code0, _, err0, _ = launch.result(0)
    code1 = launch.result(1)[0]
    assert code1 == -signal.SIGKILL
    assert code0 == 0, err0
    later = {rank: r["env"] for (a, rank), r in launch.reports().items() if a > 0}
    assert sorted(later) == [0, 1]
    assert {e["WORLD_SIZE"] for e in later.values()} == {"2"}


def test_dynamic_rdzv_scale_up(jobs):
    """``test_dynamic_rdzv_scale_up`` / ``test_run_membership_change``: a --nnodes 1:2 job
    runs on one launcher (world size 1, waiting for the scale event); a second launcher
    joins; the job restarts with both (world size 2, whose ranks sum through the
    rendezvous endpoint), spending no restart (--max-restarts 0): torch's
    TORCHELASTIC_RESTART_COUNT stays 0, the attempt (JDIST_RESTART_COUNT) is 1."""
    launch = jobs["scale_up"]
    code0, _, err0, _ = launch.result(0)
    assert code0 == 0, err0
    assert launch.result(1)[0] == 0, launch.result(1)
    assert "joined; restarting the job with it" in err0 and "no restart spent" in err0
    reports = launch.reports()
    assert reports[0, 0]["env"]["WORLD_SIZE"] == "1"
    later = {rank: r for (a, rank), r in reports.items() if a == 1}
    assert sorted(later) == [0, 1]
    for r in later.values():
        assert r["env"]["WORLD_SIZE"] == "2" and r["sum"] == 1
        assert r["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert r["env"]["JDIST_RESTART_COUNT"] == "1"


# --- functions and their return values (spawn) ---------------------------------------------
def _happy_function():
    return None


def _echo(msg):
    return msg


def dummy_compute():
    return np.random.rand(100, 100)


def _function_cases():
    return {"happy": _happy_function(), "echo": _echo("foo"), "compute": dummy_compute()}


@pytest.fixture(scope="module")
def function_results():
    return spawn(_function_cases, nprocs=2, timeout=120)


def test_run_happy_function(function_results):
    assert [r["happy"] for r in function_results] == [None, None]


def test_run_function_with_return_value(function_results):
    assert [r["echo"] for r in function_results] == ["foo", "foo"]


def test_dummy_compute(function_results):
    for r in function_results:
        assert isinstance(r["compute"], np.ndarray) and r["compute"].shape == (100, 100)


# --- the launcher's configuration (shutdown_timeout_test) ---------------------------------
def test_launch_config_custom_shutdown_timeout():
    assert parse_args(["--shutdown-timeout", "120", "x.py"]).shutdown_timeout == 120


def test_shutdown_timeout_zero():
    assert parse_args(["--shutdown-timeout", "0", "x.py"]).shutdown_timeout == 0


def test_launch_config_default_shutdown_timeout():
    """Departure: jdist-run's default grace is 5 s (torch's 30 s)."""
    assert parse_args(["x.py"]).shutdown_timeout == 5


def test_shutdown_timeout_validation_negative(capsys):
    """A negative value is refused with torch's ValueError and words (a usage error of
    jdist-run: it also exits 2 after the usage line)."""
    with pytest.raises(ValueError, match="shutdown_timeout must be non-negative") as e:
        parse_args(["--shutdown-timeout", "-5", "x.py"])
    assert isinstance(e.value, SystemExit) and e.value.code == 2
    assert "--shutdown-timeout: shutdown_timeout must be non-negative, got -5" in (
        capsys.readouterr().err)
