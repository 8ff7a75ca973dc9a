"""jdist-run's shutdown and exit-barrier timeouts, as torch's
``exit_barrier_timeout_test.py`` and ``shutdown_timeout_test.py`` test its LaunchConfig:
the flag, else torch's ``TORCH_ELASTIC_*`` variable, else the default; the flag wins
over the variable; zero is valid; negative is refused with torch's ``ValueError`` and
words (a usage error of the command line: it also exits 2 after the usage line). The
shutdown timeout's negative case is test_torch_agent.py's.

The behaviour: with several nodes, a launcher whose workers finished waits at most
``--exit-barrier-timeout`` for the other nodes' workers, then leaves with success while
the job goes on (torch's exit barrier never fails the job).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jdist.launch._config import parse_args
from jdist.store import free_port

_EXIT = "TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT"
_SHUTDOWN = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def _cfg(flags: list[str], **env: str):
    return parse_args([*flags, "train.py"], environ=env)


# --- exit_barrier_timeout_test.py ---------------------------------------------------------
def test_launch_config_default_exit_barrier_timeout():
    assert _cfg([]).exit_barrier_timeout == 300


def test_launch_config_custom_exit_barrier_timeout():
    assert _cfg(["--exit-barrier-timeout", "600"]).exit_barrier_timeout == 600
    assert _cfg(["--exit_barrier_timeout=600"]).exit_barrier_timeout == 600


def test_launch_config_env_var_exit_barrier_timeout():
    assert _cfg([], **{_EXIT: "900"}).exit_barrier_timeout == 900


def test_launch_config_explicit_overrides_env():
    cfg = _cfg(["--exit-barrier-timeout", "120"], **{_EXIT: "900"})
    assert cfg.exit_barrier_timeout == 120


@pytest.mark.parametrize("flags, env", [(["--exit-barrier-timeout", "-1"], {}),
                                        ([], {_EXIT: "-1"})])
def test_exit_barrier_timeout_validation_negative(flags, env, capsys):
    with pytest.raises(ValueError, match="exit_barrier_timeout must be non-negative") as e:
        _cfg(flags, **env)
    assert isinstance(e.value, SystemExit) and e.value.code == 2
    err = capsys.readouterr().err
    assert "exit_barrier_timeout must be non-negative, got -1" in err


def test_exit_barrier_timeout_zero():
    assert _cfg(["--exit-barrier-timeout", "0"]).exit_barrier_timeout == 0
    assert _cfg([], **{_EXIT: "0"}).exit_barrier_timeout == 0


def test_exit_barrier_timeout_not_a_number(capsys):
    with pytest.raises(SystemExit):
        _cfg([], **{_EXIT: "soon"})
    assert f"{_EXIT}='soon': expected a number of seconds" in capsys.readouterr().err


# --- shutdown_timeout_test.py --------------------------------------------------------------
def test_shutdown_timeout_default_and_flag_spellings():
    assert _cfg([]).shutdown_timeout == 5
    for flags in (["--shutdown-timeout", "7"], ["--shutdown_timeout=7"], ["--grace", "7"]):
        assert _cfg(flags).shutdown_timeout == 7


def test_shutdown_timeout_env_var():
    assert _cfg([], **{_SHUTDOWN: "45"}).shutdown_timeout == 45


def test_shutdown_timeout_explicit_overrides_env():
    assert _cfg(["--shutdown-timeout", "12"], **{_SHUTDOWN: "45"}).shutdown_timeout == 12


# --- the exit barrier itself ----------------------------------------------------------------
def test_a_finished_node_leaves_after_its_exit_barrier_timeout(tmp_path):
    """``workers_drift_fail``: node 1's worker ends at once, node 0's 4 s later; with
    --exit-barrier-timeout 0 node 1's launcher leaves with success before node 0's
    worker ends (the exit barrier does not fail the job); node 0, which hosts the
    launchers' store, finishes its job and succeeds too."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""\
        import os, sys, time
        if os.environ["GROUP_RANK"] == "0":
            time.sleep(4)
        open(os.path.join(sys.argv[1], "done" + os.environ["GROUP_RANK"]), "w").close()
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("JDIST_AUTH_TOKEN", "JDIST_START_METHOD", "JDIST_FORKSERVER_PRELOAD")}
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
              str(free_port()), "--exit-barrier-timeout", "0", "--rdzv-timeout", "60"]
    procs = [subprocess.Popen([sys.executable, "-m", "jdist.launch", *common, "--node-rank",
                               str(n), str(script), str(tmp_path)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for n in (0, 1)]
    try:
        _, err1 = procs[1].communicate(timeout=60)
        assert procs[1].returncode == 0, err1
        assert (tmp_path / "done1").exists()
        assert not (tmp_path / "done0").exists(), "node 1 waited for node 0's worker"
        assert ("node 1's workers finished; the other nodes' did not within "
                "--exit-barrier-timeout 0s: leaving without them (the job goes on)") in err1
        _, err0 = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 0, err0
        assert (tmp_path / "done0").exists()
    finally:
        for p in procs:
            p.kill()
