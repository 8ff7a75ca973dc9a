"""torch's test/distributed/launcher/test_run.py, translated: ``jdist-run``'s entry point
(``jdist.launch.__main__.main``, torch's ``torch.distributed.run.main``) called in this
process, as torch's tests call theirs, with torch's flags and worker scripts
(``torch_run_bin/``: every worker writes its rank's file; the Python one asserts that
the agent's variables exist).

Budget: the workers are tiny (two per launch where torch starts four: the assertion is
the same), and only the two ``init_method`` cases import JAX.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import uuid
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from jdist.launch import __main__ as launch
from jdist.launch import _agent, _config
from jdist.launch.__main__ import main
from jdist.launch._config import parse_args
from jdist.store import free_port

BIN = Path(__file__).resolve().parent / "torch_run_bin"


def path(script: str) -> str:
    return str(BIN / script)


@pytest.fixture
def test_dir(tmp_path, monkeypatch):
    """torch's setUp: no PET_ variables, a sentinel the workers must inherit."""
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TEST_SENTINEL_PARENT", "FOOBAR")
    d = tmp_path / "touched"
    d.mkdir()
    return d


def ranks(directory: Path) -> set[str]:
    return set(os.listdir(directory))


def seen(directory: Path, rank: int) -> dict[str, str]:
    """The variables rank ``rank`` of run_script.py saw."""
    return json.loads((directory / str(rank)).read_text())


def test_launch_user_script_python(test_dir):
    run_id = str(uuid.uuid4().int)
    args = ["--nnodes=1", "--nproc-per-node=2", f"--rdzv-id={run_id}", "--monitor-interval=1",
            "--start-method=spawn", path("run_script.py"), f"--touch-file-dir={test_dir}"]
    assert main(args) == 0
    assert ranks(test_dir) == {"0", "1"}
    env = seen(test_dir, 1)
    assert env["TORCHELASTIC_RUN_ID"] == run_id and env["TEST_SENTINEL_PARENT"] == "FOOBAR"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["GROUP_RANK"],
            env["ROLE_RANK"], env["ROLE_NAME"]) == ("1", "1", "2", "0", "1", "default")


def test_launch_user_script_python_caffe2_bc(test_dir):
    master_port = free_port()
    args = ["--nnodes=1", "--nproc-per-node=2", "--monitor-interval=1", "--start-method=spawn",
            "--master-addr=localhost", f"--master-port={master_port}", "--node-rank=0",
            path("run_script.py"), f"--touch-file-dir={test_dir}"]
    assert main(args) == 0
    assert ranks(test_dir) == {"0", "1"}
    assert {(seen(test_dir, r)["MASTER_ADDR"], seen(test_dir, r)["MASTER_PORT"])
            for r in (0, 1)} == {("localhost", str(master_port))}


def _bash_args(test_dir, nproc: int | str | None = 2) -> tuple[list[str], list[str]]:
    args = ["--nnodes=1", f"--rdzv-id={uuid.uuid4().int}", "--monitor-interval=1",
            "--start-method=spawn", "--no-python"]
    if nproc is not None:
        args.insert(1, f"--nproc-per-node={nproc}")
    return args, [path("run_script.sh"), str(test_dir)]


def test_launch_user_script_bash(test_dir):
    args, script_args = _bash_args(test_dir)
    with pytest.raises(ValueError, match="Don't use both the '--no-python' flag and the "
                                         "'--module' flag at the same time"):
        main(args + ["--module"] + script_args)
    assert main(args + script_args) == 0
    assert ranks(test_dir) == {"0", "1"}


def test_launch_user_script_default_nproc(test_dir):
    args, script_args = _bash_args(test_dir, nproc=None)
    with pytest.raises(ValueError):
        main(args + ["--module"] + script_args)
    assert main(args + script_args) == 0
    assert ranks(test_dir) == {"0"}


def test_launch_with_env_vars(test_dir, monkeypatch):
    for name, value in {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2",
                        "PET_RDZV_ID": str(uuid.uuid4().int), "PET_MONITOR_INTERVAL": "1",
                        "PET_START_METHOD": "spawn", "PET_NO_PYTHON": "1"}.items():
        monkeypatch.setenv(name, value)
    script_args = [path("run_script.sh"), str(test_dir)]
    monkeypatch.setenv("PET_MODULE", "1")
    with pytest.raises(ValueError):
        main(script_args)
    monkeypatch.setenv("PET_MODULE", "0")
    assert main(script_args) == 0
    assert ranks(test_dir) == {"0", "1"}


def _nproc_launch(test_dir, nproc_type: str, expected_number: int) -> None:
    args, script_args = _bash_args(test_dir, nproc=nproc_type)
    assert main(args + script_args) == 0
    assert ranks(test_dir) == {str(i) for i in range(expected_number)}


def test_nproc_launch_auto_configurations(test_dir, monkeypatch):
    monkeypatch.setattr(_config, "local_gpu_count", lambda environ: 0)  # no accelerator
    expected = len(os.sched_getaffinity(0))  # torch._utils.cpu_count()
    assert _config.resolve_nproc("auto", {}) == _config.resolve_nproc("cpu", {}) == expected
    monkeypatch.setattr(_config, "_cpu_count", lambda: 2)  # launch few, whatever the host
    _nproc_launch(test_dir, "auto", 2)


def test_nproc_launch_number_configurations(test_dir):
    _nproc_launch(test_dir, "2", 2)


def test_nproc_launch_unknown_configurations(test_dir):
    with pytest.raises(ValueError, match="Unsupported nproc_per_node value: unknown"):
        _nproc_launch(test_dir, "unknown", 4)


def test_nproc_gpu_launch_configurations(test_dir, monkeypatch):
    monkeypatch.setattr(_config, "local_gpu_count", lambda environ: 3)
    _nproc_launch(test_dir, "auto", 3)
    _nproc_launch(test_dir, "gpu", 3)
    monkeypatch.setattr(_config, "local_gpu_count", lambda environ: 0)
    with pytest.raises(ValueError, match="Cuda is not available."):
        _nproc_launch(test_dir, "gpu", 3)


def test_local_gpu_count_reads_cuda_visible_devices(monkeypatch):
    """(jdist) ``gpu``/``auto`` count /dev/nvidiaN, narrowed by CUDA_VISIBLE_DEVICES."""
    monkeypatch.setattr("glob.glob", lambda pattern: [f"/dev/nvidia{i}" for i in range(4)]
                        + ["/dev/nvidiactl", "/dev/nvidia-uvm"])
    assert _config.local_gpu_count({}) == 4
    assert _config.local_gpu_count({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert _config.local_gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == 1
    assert _config.local_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_nproc_xpu_launch_configurations(test_dir):
    """Departure: JAX has no XPU backend; ``xpu`` is refused with torch's words."""
    with pytest.raises(ValueError, match="Xpu is not available.: jdist runs on JAX"):
        _nproc_launch(test_dir, "xpu", 3)


def _elastic_args(conf: str, nproc: int = 2) -> list[str]:
    return ["--nnodes=1:2", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}", conf, f"--rdzv-id={uuid.uuid4().int}",
            "--monitor-interval=1", "--start-method=spawn"]


def test_launch_elastic(test_dir):
    # only one node of max 2: it starts alone after the last call (torch's quoted conf)
    args = _elastic_args("--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'")
    assert main(args + [path("run_script.py"), f"--touch-file-dir={test_dir}"]) == 0
    assert ranks(test_dir) == {"0", "1"}


def test_launch_elastic_worker_raise_exception(test_dir, capfd):
    """Departure: ``main`` returns the launcher's exit code (1) and prints the failed
    rank's traceback, where torch's raises ``ChildFailedError``."""
    args = _elastic_args("--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'")
    assert main(args + ["--max-restarts=0", path("run_script.py"), "--fail"]) == 1
    err = capfd.readouterr().err
    assert "job failed: rank 0" in err or "job failed: rank 1" in err
    assert "RuntimeError: raising exception since --fail flag was set" in err


class MockException(Exception):
    pass


def test_launch_elastic_agent_raise_exception(test_dir, monkeypatch):
    def agent_run(*args, **kwargs):
        raise MockException

    monkeypatch.setattr(_agent, "_rounds", agent_run)  # the agent's run loop
    args = _elastic_args("--rdzv_conf=timeout=5,last_call_timeout=1")
    with pytest.raises(MockException):
        main(args + ["--max-restarts=0", path("run_script.py"),
                     f"--touch-file-dir={test_dir}"])


def test_launch_standalone(test_dir):
    args = ["--nnodes=1", "--nproc-per-node=2", "--standalone", "--monitor-interval=1",
            "--start-method=spawn", path("run_script.py"), f"--touch-file-dir={test_dir}"]
    assert main(args) == 0
    assert ranks(test_dir) == {"0", "1"}


def test_launch_run_path(test_dir):
    args = ["--run-path", "--nnodes=1", "--nproc-per-node=2", "--monitor-interval=1",
            "--start-method=spawn", path("run_script.py"), f"--touch-file-dir={test_dir}"]
    assert main(args) == 0
    assert ranks(test_dir) == {"0", "1"}


def test_launch_elastic_multiple_agents(test_dir):
    nnodes, nproc_per_node = 2, 2
    args = _elastic_args("--rdzv_conf=timeout=5", nproc=nproc_per_node) + [
        path("run_script.py"), f"--touch-file-dir={test_dir}"]
    other = subprocess.Popen([sys.executable, "-m", "jdist.launch", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert main(args) == 0
        _, err = other.communicate(timeout=60)
    finally:
        other.kill()
    assert other.returncode == 0, err
    assert ranks(test_dir) == {str(i) for i in range(nnodes * nproc_per_node)}
    groups = {seen(test_dir, r)["GROUP_RANK"] for r in range(4)}
    assert groups == {"0", "1"}  # one job of both launchers' workers


def test_min_max_nodes_parse():
    min_nodes, max_nodes = launch.parse_min_max_nnodes("1")
    assert min_nodes == max_nodes == 1
    assert launch.parse_min_max_nnodes("2:20") == (2, 20)
    with pytest.raises(RuntimeError, match='nnodes=2:20:30 is not in "MIN:MAX" format'):
        launch.parse_min_max_nnodes("2:20:30")
    cfg = parse_args(["--nnodes", "2:20", "s.py"], {})  # (jdist) what jdist-run makes of it
    assert (cfg.min_nodes, cfg.nnodes) == (2, 20)
    with pytest.raises(ValueError, match="--nnodes must be N or MIN:MAX, got '2:20:30'"):
        parse_args(["--nnodes", "2:20:30", "s.py"], {})


def test_launch_shutdown(test_dir):
    """The launcher shuts its rendezvous down: the store's port is free once it returns."""
    port = free_port()
    args = ["--nnodes=1:2", "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf=last_call_timeout=0.1", "--monitor-interval=1",
            "--start-method=spawn", path("run_script.py"), f"--touch-file-dir={test_dir}"]
    assert main(args) == 0
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (past TIME_WAIT)
        s.bind(("127.0.0.1", port))  # nobody listens there any more


def test_is_torchelastic_launched(test_dir):
    out_file = test_dir / "out"
    assert main(["--run-path", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=1",
                 path("is_torchelastic_launched.py"), f"--out-file={out_file}"]) == 0
    assert out_file.read_text() == "True"


def test_is_torchelastic_launched_with_logs_spec_defined(capsys):
    """Departure: no ``--logs-specs`` plug-ins (``--log-dir``/``--redirects``/``--tee``
    choose where output goes); the flag is refused."""
    with pytest.raises(SystemExit) as info:
        parse_args(["--nnodes=1", "--logs_specs=default", "s.py"], {})
    assert info.value.code == 2
    assert "unrecognized arguments: --logs_specs=default" in capsys.readouterr().err


def test_logs_logs_spec_entrypoint_must_be_defined():
    """Departure: see the previous test; an unknown spec is a ValueError as in torch,
    because jdist-run refuses the flag itself."""
    with pytest.raises(ValueError):
        main(["--run-path", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=1",
              "--logs_specs=DOESNOT_EXIST", path("run_script.py")])


def test_is_not_torchelastic_launched(test_dir, monkeypatch):
    out_file = test_dir / "out"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(sys, "argv", [path("is_torchelastic_launched.py"),
                                      f"--out-file={out_file}"])
    runpy.run_path(sys.argv[0], run_name="__main__")
    assert out_file.read_text() == "False"


def _handlers():
    return [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]


def test_no_launch_leaves_its_signal_handlers_behind(test_dir, tmp_path, capsys):
    """main() called in-process gives the caller its SIGINT/SIGTERM/SIGHUP handlers
    back on every way out: a missing script, a --no-python file that is not executable
    (both exit 2 before anything starts) and a job that ran."""
    before = _handlers()
    script = tmp_path / "not_executable.sh"
    script.write_text("exit 0\n")
    assert main([str(tmp_path / "missing.py")]) == 2
    assert _handlers() == before
    assert main(["--no-python", str(script)]) == 2
    assert _handlers() == before
    err = capsys.readouterr().err
    assert "script" in err and "not found" in err and "is not an executable file" in err
    assert main(["--nproc-per-node=1", "--no-python", path("run_script.sh"),
                 str(test_dir)]) == 0
    assert _handlers() == before


def _init_method(init: str, port: int) -> None:
    assert main(["--run-path", "--nnodes=1", "--nproc-per-node=2", "--master-addr=localhost",
                 f"--master-port={port}", "--monitor-interval=1", path("init_method.py"),
                 f"--init-method={init}"]) == 0


def test_init_method_tcp_with_torchelastic():
    port = free_port()
    _init_method(f"tcp://localhost:{port}", port)


def test_init_method_env_with_torchelastic():
    _init_method("env://", free_port())


def test_capture_logs_using_default_logs_specs(test_dir, tmp_path, monkeypatch):
    """Departure: --redirects/--tee need --log-dir (torch writes to a temporary
    directory without one); the line prefix template is torch's."""
    args = ["--nnodes=1", "--nproc-per-node=2", f"--rdzv-id={uuid.uuid4().int}",
            f"--log-dir={tmp_path / 'logs'}", "--redirect=3", "--tee=3", "--monitor-interval=1",
            "--start-method=spawn", "--no-python", path("run_script.sh"), str(test_dir)]
    captured_out, captured_err = io.StringIO(), io.StringIO()
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")
    with redirect_stdout(captured_out), redirect_stderr(captured_err):
        assert main(args) == 0
    for i in range(2):
        assert f"[rank{i}]: creating " in captured_out.getvalue()
        log = tmp_path / "logs" / "attempt_0" / f"rank_{i}" / "stdout.log"
        assert log.read_text().startswith("creating ")


def test_virtual_local_rank():
    """Departure: --virtual-local-rank makes every rank see ``cuda:0``; a JAX process
    addresses its devices through jax.devices(), with no process-wide CUDA index."""
    with pytest.raises(SystemExit):
        parse_args(["--virtual-local-rank", "s.py"], {})
