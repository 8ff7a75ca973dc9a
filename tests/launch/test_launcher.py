"""jdist-run end to end: environment, output prefixes, failures, restarts, two nodes, signals,
and the fork-server start (``--start-method forkserver``; tests taking ``start_method``
run under both).

The worker scripts are tiny and never import jax, so each launch costs about the
launcher's own start-up (one test preloads JAX in a fork server).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from jdist.launch import free_port
from tests.helpers import process_alive

ROOT = str(Path(__file__).resolve().parents[2])


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("JDIST_AUTH_TOKEN", None)
    env.update(extra)
    return env


def _launch(args, env=None, timeout=60, cwd=None):
    return subprocess.run([sys.executable, "-m", "jdist.launch", *args], env=env or _env(),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


_REPORT = """\
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JDIST_RESTART_COUNT",
            "JDIST_MAX_RESTARTS", "JDIST_AUTH_TOKEN", "XLA_FLAGS"]
    print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}))
    print("second line\\nthird line")
    print("to stderr", file=sys.stderr)
"""


def _envs(stdout):
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"\[rank (\d+)\] ENV (.*)", line)
        if m:
            found[int(m.group(1))] = json.loads(m.group(2))
    return found


def test_env_vars_and_prefixed_output_and_log_dir(tmp_path):
    script = _script(tmp_path, "report.py", _REPORT)
    res = _launch(["--nproc-per-node", "3", "--devices-per-proc", "2", "--max-restarts", "2",
                   "--log-dir", str(tmp_path / "logs"), "--tee", script])
    assert res.returncode == 0, res.stderr
    envs = _envs(res.stdout)
    assert sorted(envs) == [0, 1, 2]
    for r, e in envs.items():
        assert e["RANK"] == e["LOCAL_RANK"] == str(r)
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("3", "3")
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert (e["JDIST_RESTART_COUNT"], e["JDIST_MAX_RESTARTS"]) == ("0", "2")
        assert "--xla_force_host_platform_device_count=2" in e["XLA_FLAGS"]
    assert len({e["JDIST_AUTH_TOKEN"] for e in envs.values()}) == 1  # one token per job
    assert len(envs[0]["JDIST_AUTH_TOKEN"]) >= 32
    assert len({e["MASTER_PORT"] for e in envs.values()}) == 1
    for r in range(3):  # every line carries its rank, on the right stream
        assert f"[rank {r}] second line" in res.stdout
        assert f"[rank {r}] third line" in res.stdout
        assert f"[rank {r}] to stderr" in res.stderr
        log = tmp_path / "logs" / "attempt_0" / f"rank_{r}"
        assert "third line" in (log / "stdout.log").read_text()
        assert (log / "stderr.log").read_text() == "to stderr\n"
    assert all(line.startswith("[rank ") for line in res.stdout.splitlines())


def test_a_failing_rank_ends_the_others_and_is_named(tmp_path, start_method):
    script = _script(tmp_path, "fail.py", f"""\
        import os, signal, sys, time
        rank = os.environ["RANK"]
        if rank == "1":
            time.sleep(0.3)
            print("something broke in rank 1", file=sys.stderr)
            open({str(tmp_path / "t_fail")!r}, "w").write(repr(time.time()))
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL can end rank 0
        open({str(tmp_path / "pid0")!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    res = _launch(["--nproc-per-node", "2", "--shutdown-timeout", "1", "--max-restarts", "1",
                   script])
    t_end = time.time()
    assert res.returncode == 3, res.stderr
    assert "rank 1 exited with code 3; restarting the job (attempt 2 of 2)" in res.stderr
    assert "rank 1 (node 0, local rank 1) exited with code 3 on attempt 2 of 2" in res.stderr
    assert "something broke in rank 1" in res.stderr.split("job failed:")[1]
    t_fail = float((tmp_path / "t_fail").read_text())
    assert t_end - t_fail < 1 + 2  # grace + 2 s
    assert not process_alive(int((tmp_path / "pid0").read_text()))


def test_max_restarts_recovers_from_a_first_attempt_crash(tmp_path):
    script = _script(tmp_path, "flaky.py", """\
        import os, sys
        attempt = int(os.environ["JDIST_RESTART_COUNT"])
        if os.environ["RANK"] == "0" and attempt < int(sys.argv[1]):
            sys.exit(5)
        print("ok on attempt", attempt)
    """)
    res = _launch(["--nproc-per-node", "2", "--max-restarts", "2", script, "1"])
    assert res.returncode == 0, res.stderr
    assert "rank 0 exited with code 5; restarting the job (attempt 2 of 3)" in res.stderr
    assert "[rank 0] ok on attempt 1" in res.stdout and "[rank 1] ok on attempt 1" in res.stdout
    assert "attempt 3" not in res.stderr


def test_two_launchers_form_one_job_and_restart_together(tmp_path, start_method):
    _script(tmp_path, "two.py", _REPORT + """\
    import time
    attempt = os.environ["JDIST_RESTART_COUNT"]
    if os.environ["RANK"] == "3" and attempt == "0":
        sys.exit(7)  # a failure on node 1 restarts node 0's workers too
    time.sleep(30 if attempt == "0" else 0.2)
    """)
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", str(port),
              "--max-restarts", "1", "--shutdown-timeout", "1", "--rdzv-timeout", "30"]
    env = _env(JDIST_AUTH_TOKEN="two-node-secret")
    procs = [subprocess.Popen([sys.executable, "-m", "jdist.launch", *common, "--node-rank",
                               str(n), "-m", "two"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
             for n in (1, 0)]  # -m runs a module (found from the working directory)
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    node1, node0 = (_envs(o) for o, _ in outs)
    assert sorted(node0) == [0, 1] and sorted(node1) == [2, 3]
    everyone = {**node0, **node1}
    assert {e["WORLD_SIZE"] for e in everyone.values()} == {"4"}
    assert {e["GROUP_RANK"] for e in node1.values()} == {"1"}
    assert {e["JDIST_RESTART_COUNT"] for e in everyone.values()} == {"1"}  # last attempt
    assert {e["JDIST_AUTH_TOKEN"] for e in everyone.values()} == {"two-node-secret"}
    ports = {e["MASTER_PORT"] for e in everyone.values()}
    assert len(ports) == 1 and ports != {str(port)}  # workers rendezvous on their own port
    for _, err in outs:
        assert "rank 3 exited with code 7; restarting the job (attempt 2 of 2)" in err



def test_sigterm_to_the_launcher_leaves_no_process(tmp_path, start_method):
    script = _script(tmp_path, "sleepy.py", f"""\
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        rank = os.environ["RANK"]
        with open(os.path.join({str(tmp_path)!r}, f"pids{{rank}}"), "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(60)
    """)
    launcher = subprocess.Popen([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                                 "--shutdown-timeout", "2", script], env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    files = [tmp_path / "pids0", tmp_path / "pids1"]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.05)
    pids = [int(p) for f in files for p in f.read_text().split()]
    assert all(process_alive(p) for p in pids)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "got SIGTERM; stopped every worker" in err
    deadline = time.monotonic() + 5
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if process_alive(p)]


def test_a_killed_launcher_takes_its_workers_and_stops_the_job(tmp_path, start_method):
    script = _script(tmp_path, "hang.py", f"""\
        import os, time
        with open(os.path.join({str(tmp_path)!r}, "pid" + os.environ["RANK"]), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    """)
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", str(port),
              "--max-restarts", "3", "--heartbeat-timeout", "2", "--shutdown-timeout", "1",
              script]
    procs = [subprocess.Popen([sys.executable, "-m", "jdist.launch", "--node-rank", str(n),
                               *common], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    files = [tmp_path / "pid0", tmp_path / "pid1"]
    deadline = time.monotonic() + 30
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    pids = [int(f.read_text()) for f in files]
    procs[1].kill()  # node 1's launcher dies without a word
    t0 = time.monotonic()
    _, err = procs[0].communicate(timeout=30)
    procs[1].communicate(timeout=5)
    assert procs[0].returncode == 1, err
    assert "the launcher of node 1 stopped responding" in err
    assert "restarting" not in err  # a vanished node is not restarted
    assert time.monotonic() - t0 < 2 + 1 + 5
    assert not [p for p in pids if process_alive(p)]  # rank 1 died with its launcher too


def test_forkserver_workers_run_the_script_as_python_does_and_restarts_reuse_the_server(
        tmp_path):
    script = _script(tmp_path, "fs.py", """\
        import json, os, sys
        seen = {
            "preloaded": sorted(m for m in ("jax", "flax", "optax") if m in sys.modules),
            "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
            "rank": os.environ["RANK"], "attempt": os.environ["JDIST_RESTART_COUNT"],
            "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0)}
        print("FS " + json.dumps(seen), flush=True)
        if seen["rank"] == "1" and seen["attempt"] == "0":
            sys.exit(4)
    """)
    (tmp_path / "run").mkdir()
    res = _launch(["--nproc-per-node", "2", "--max-restarts", "1", "--start-method",
                   "forkserver", script, "x", "--y"], cwd=str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert "rank 1 exited with code 4; restarting the job (attempt 2 of 2)" in res.stderr
    seen = [json.loads(line.split("FS ", 1)[1]) for line in res.stdout.splitlines()
            if "] FS " in line]
    assert sorted((s["rank"], s["attempt"]) for s in seen) == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    for s in seen:
        assert s["preloaded"] == ["flax", "jax", "optax"]  # imported before the script
        assert s["name"] == "__main__" and s["argv"] == [script, "x", "--y"]
        assert s["path0"] == str(tmp_path) and s["cwd"] == str(tmp_path / "run")
        assert s["sid"] == s["pid"]  # its own session: stopping its group reaches all
    servers = {s["ppid"] for s in seen}
    assert len(servers) == 1  # both attempts forked from one server: imported once
    assert len({s["pid"] for s in seen}) == 4
    assert not process_alive(servers.pop())  # the server ended with the launcher


def test_attempts_share_a_compilation_cache_that_ends_with_the_job(tmp_path):
    script = _script(tmp_path, "cached.py", """\
        import json, os, sys
        import jax, jax.numpy as jnp
        events = []
        jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
        jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(5.0)).block_until_ready()
        keys = ["JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JDIST_RESTART_COUNT"]
        seen = {k: os.environ.get(k) for k in keys}
        seen["hits"] = events.count("/jax/compilation_cache/cache_hits")
        print("CACHE " + json.dumps(seen), flush=True)
        if seen["JDIST_RESTART_COUNT"] == "0":
            sys.exit(1)
    """)
    env = {k: v for k, v in _env().items()
           if k != "JAX_COMPILATION_CACHE_DIR" and not k.startswith("JAX_PERSISTENT_CACHE")}

    def attempts(res):
        assert res.returncode == 0, res.stderr
        return [json.loads(line.split("CACHE ", 1)[1]) for line in res.stdout.splitlines()
                if "] CACHE " in line]

    first, second = attempts(_launch(["--max-restarts", "1", script], env=env, timeout=120))
    cache = first["JAX_COMPILATION_CACHE_DIR"]
    assert cache and second["JAX_COMPILATION_CACHE_DIR"] == cache
    assert "jax-cache" in os.path.basename(cache)
    assert (first["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"],
            first["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]) == ("0", "-1")
    assert first["hits"] == 0 and second["hits"] >= 1  # the restart loaded the program
    assert not os.path.exists(cache)  # removed with the job
    mine = tmp_path / "my-cache"  # the user's own cache is used and kept
    ours = os.path.join(os.path.dirname(cache), "jdist-run-*-jax-cache-*")
    before = set(glob.glob(ours))
    first, second = attempts(_launch(["--max-restarts", "1", script], timeout=120,
                                     env=dict(env, JAX_COMPILATION_CACHE_DIR=str(mine))))
    assert first["JAX_COMPILATION_CACHE_DIR"] == str(mine) and mine.is_dir()
    assert not set(glob.glob(ours)) - before  # and no directory of jdist-run's is made
    assert first["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] is None  # JAX's own
    first, second = attempts(_launch(["--max-restarts", "1", "--no-compilation-cache",
                                      script], env=env, timeout=120))
    assert first["JAX_COMPILATION_CACHE_DIR"] is None and second["hits"] == 0
