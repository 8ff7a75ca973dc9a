"""Real jobs on loopback started the way schedulers start them, with no launcher.

The DDP demo (``examples/train_ddp.py --smoke``) runs as 2 processes x 2 virtual
devices under ``jdist-run`` (the reference), then with the environment ``srun`` gives
its tasks, then under Open MPI's real ``mpirun``; each must train to the same losses.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jdist.launch._cluster import derived_port
from tests.helpers import COMPILE_FLAG

ROOT = str(Path(__file__).resolve().parents[2])
pytestmark = pytest.mark.slow(seconds=30)

_DRIVER = """\
    import json, sys
    sys.path.insert(0, {root!r})
    from examples.train_ddp import main
    import jdist
    out = main(["--smoke", "--devices", "2"])
    job = jdist.collectives.describe_job()
    print("RESULT " + json.dumps({{"rank": out["rank"], "world": out["world"],
                                  "losses": out["losses"], "source": job.source}}),
          flush=True)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
            "JDIST_AUTH_TOKEN", "XLA_FLAGS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = COMPILE_FLAG  # the same in every job
    env.update(extra)
    return env


def _results(text):
    found = {}
    for line in text.splitlines():
        m = re.search(r"RESULT (\{.*\})", line)
        if m:
            r = json.loads(m.group(1))
            found[r["rank"]] = r
    return found


def _driver(tmp_path):
    path = tmp_path / "driver.py"
    path.write_text(textwrap.dedent(_DRIVER.format(root=ROOT)))
    return str(path)


def _port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _check(got, want, source):
    assert sorted(got) == [0, 1], got
    for r in got.values():
        assert r["world"] == 2 and r["source"] == source
        np.testing.assert_allclose(r["losses"], want, rtol=1e-6, atol=1e-7)


def _popen(cmd, env):
    return subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_srun_environment_and_mpirun_train_like_jdist_run(tmp_path):
    """The three jobs run side by side (each mostly waits on its own compiles)."""
    driver = _driver(tmp_path)
    runs = {"jdist-run": [_popen([sys.executable, "-m", "jdist.launch", "--nproc-per-node",
                                  "2", "--devices-per-proc", "2", driver], _env())]}
    while True:  # srun's environment for 2 tasks of one step, with a free derived port
        job = str(secrets.randbelow(10**6))
        if _port_is_free(derived_port(job, 0, 0)):
            break
    runs["slurm"] = [_popen([sys.executable, driver], _env(
        SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_NTASKS="2",
        SLURM_LOCALID=str(r), SLURM_NODEID="0", SLURM_STEP_NODELIST="localhost",
        SLURM_JOB_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2", SLURM_NNODES="1"))
        for r in range(2)]
    mpirun = shutil.which("mpirun")
    if mpirun is not None:  # Open MPI's real launcher, as root if need be
        runs["openmpi"] = [_popen([mpirun, "-n", "2", "--oversubscribe", "--bind-to", "none",
                                   sys.executable, driver], _env(
            OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMPI_MCA_btl="self,tcp"))]
    outs = {}
    try:
        for name, procs in runs.items():
            outs[name] = [p.communicate(timeout=400) for p in procs]
    finally:
        for procs in runs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for name, procs in runs.items():
        for p, (out, err) in zip(procs, outs[name], strict=True):
            assert p.returncode == 0, f"{name}: {(out + err)[-3000:]}"
    ref_out = "".join(o + e for o, e in outs["jdist-run"])
    # the runtime's routine messages are real here (gloo, the coordination service)
    assert "peer ranks" not in ref_out and "recoverable task" not in ref_out
    ref = _results(ref_out)
    assert sorted(ref) == [0, 1] and {r["source"] for r in ref.values()} == {"jdist-run"}
    want = ref[0]["losses"]
    assert len(want) == 3
    for name in runs:
        if name != "jdist-run":
            _check(_results("".join(o for o, _ in outs[name])), want, name)
    if mpirun is None:
        pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin); "
                    "the jdist-run and srun-environment runs above passed")
