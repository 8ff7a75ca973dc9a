"""jdist-run's pure parts: flag parsing/validation and the worker environment."""

from __future__ import annotations

import pytest

from jdist.launch._config import parse_args
from jdist.launch._env import JobInfo, worker_command, worker_env, xla_threads
from jdist.launch._worker_group import describe_exit, exit_code_of


def test_defaults_and_script_arguments():
    cfg = parse_args(["train.py", "--lr", "0.1", "-m"])
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node) == (1, 0, 1)
    assert cfg.master_addr == "127.0.0.1" and cfg.master_port is None
    assert cfg.max_restarts == 0 and cfg.shutdown_timeout == 5.0
    assert cfg.script == "train.py" and cfg.script_args == ("--lr", "0.1", "-m")
    assert not cfg.module
    cfg = parse_args(["--nnodes", "2", "--node-rank", "1", "--nproc_per_node", "4",
                      "--grace", "1.5", "-m", "pkg.main", "x"])
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node) == (2, 1, 4)
    assert cfg.master_port == 29500  # torch's default once there are several nodes
    assert cfg.shutdown_timeout == 1.5 and cfg.module and cfg.script == "pkg.main"


def test_start_method_from_the_flag_or_the_environment():
    from jdist.launch._forkserver import DEFAULT_PRELOAD

    cfg = parse_args(["s.py"], environ={})
    assert cfg.start_method == "spawn" and cfg.preload == DEFAULT_PRELOAD
    env = {"JDIST_START_METHOD": "forkserver", "JDIST_FORKSERVER_PRELOAD": "jax, optax"}
    cfg = parse_args(["s.py"], environ=env)
    assert cfg.start_method == "forkserver" and cfg.preload == ("jax", "optax")
    cfg = parse_args(["--start-method", "fork", "--forkserver-preload", "numpy", "s.py"],
                     environ=env)  # the flags win; fork is taken as spawn, as in spawn()
    assert cfg.start_method == "spawn" and cfg.preload == ("numpy",)


def test_the_restart_cache_keeps_what_the_user_set():
    from jdist.launch._env import restart_cache_env

    assert parse_args(["s.py"], environ={}).compilation_cache
    assert not parse_args(["--no-compilation-cache", "s.py"], environ={}).compilation_cache
    assert restart_cache_env({}, "/c") == {
        "JAX_COMPILATION_CACHE_DIR": "/c", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    assert restart_cache_env({"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}, "/c") == {
        "JAX_COMPILATION_CACHE_DIR": "/c", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    assert restart_cache_env({"JAX_COMPILATION_CACHE_DIR": "/mine"}, "/c") == {}


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--node-rank", "2", "s.py"], "--node-rank must be in [0, 2), got 2"),
    (["--nproc-per-node", "0", "s.py"], "--nproc-per-node must be >= 1, got 0"),
    (["--max-restarts", "-1", "s.py"], "--max-restarts must be >= 0, got -1"),
    (["--devices-per-proc", "0", "s.py"], "--devices-per-proc must be >= 1, got 0"),
    (["--tee", "s.py"], "--tee needs --log-dir"),
    (["--standalone", "--nnodes", "2", "s.py"], "--standalone runs one node"),
    (["--master-port", "70000", "s.py"], "--master-port must be in [1, 65535], got 70000"),
    (["--forkserver-preload", "jax,,optax", "s.py"],
     "must be comma-separated module names like jax,flax.nnx, got 'jax,,optax'"),
    (["--start-method", "thread", "s.py"], "invalid choice: 'thread'"),
])
def test_bad_flags_are_refused_with_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_start_method_in_the_environment_is_named(capsys):
    with pytest.raises(SystemExit):
        parse_args(["s.py"], environ={"JDIST_START_METHOD": "threads"})
    assert "JDIST_START_METHOD must be spawn, fork or forkserver, got 'threads'" in (
        capsys.readouterr().err)


def test_worker_env_of_a_two_node_job():
    job = JobInfo(world_size=6, rank_offset=3, nnodes=2, node_rank=1, local_world_size=3,
                  master_addr="127.0.0.1", master_port=4321, token="tok", run_id="rid",
                  restart_count=2, max_restarts=5)
    env = worker_env({"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8",
                      "KEEP": "1"}, job, 2, 4)
    assert {k: env[k] for k in ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", "JDIST_RESTART_COUNT", "JDIST_MAX_RESTARTS",
                                "JDIST_AUTH_TOKEN", "JDIST_DEVICES_PER_PROC"]} == {
        "RANK": "5", "LOCAL_RANK": "2", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "4321", "JDIST_RESTART_COUNT": "2", "JDIST_MAX_RESTARTS": "5",
        "JDIST_AUTH_TOKEN": "tok", "JDIST_DEVICES_PER_PROC": "4"}
    # several processes on the node: one thread each for OpenMP and for XLA's CPU client
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    assert env["KEEP"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["JDIST_XLA_CPU_THREADS"] == str(xla_threads(3))
    # the user's choice wins: more OpenMP threads, or XLA's threads set
    assert "JDIST_XLA_CPU_THREADS" not in worker_env({"OMP_NUM_THREADS": "4"}, job, 0, None)
    assert worker_env({"JDIST_XLA_CPU_THREADS": "2"}, job, 0, None)[
        "JDIST_XLA_CPU_THREADS"] == "2"
    alone = job._replace(local_world_size=1)  # one process on the node: nothing set
    assert "XLA_FLAGS" not in worker_env({}, alone, 0, None)
    assert "OMP_NUM_THREADS" not in worker_env({}, alone, 0, None)
    assert "JDIST_XLA_CPU_THREADS" not in worker_env({}, alone, 0, None)
    cmd = worker_command(99, "s.py", ("a", "b"), module=False, python="py")
    assert cmd[0] == "py" and cmd[-4:] == ["script", "s.py", "a", "b"] and "99" in cmd


def test_exit_codes_of_signal_deaths():
    assert exit_code_of(3) == 3 and exit_code_of(-9) == 137
    assert describe_exit(-15) == "was killed by signal SIGTERM"
    assert describe_exit(2) == "exited with code 2"


def test_ft_flag_and_its_one_node_limit(capsys):
    from jdist.launch._ft_agent import run_ft

    assert not parse_args(["s.py"], environ={}).ft
    cfg = parse_args(["--ft", "--nproc-per-node", "3", "s.py"], environ={})
    assert cfg.ft and cfg.nproc_per_node == 3
    two = parse_args(["--ft", "--nnodes", "2", "--node-rank", "0", "--master-addr",
                      "127.0.0.1", "s.py"], environ={})
    assert run_ft(two, {}) == 2  # refused before anything starts, naming the limit
    assert "--ft runs on one node" in capsys.readouterr().err
