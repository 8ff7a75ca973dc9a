"""jdist-run's persistent compilation cache: on by default (one directory per user and
machine), and a warm re-run loads every program on every rank, not only on rank 0
(JAX writes entries on process 0 only, and on CPU each process's keys are its own;
``jdist.collectives._compile_cache``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jdist.launch._env import JobInfo, worker_env

ROOT = str(Path(__file__).resolve().parents[2])
_JOB = JobInfo(2, 0, 1, 0, 2, "127.0.0.1", 29500, "t", "run", 0, 0)
_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
_HOST = socket.gethostname().split(".")[0]


def _expected(base: dict, enabled: bool) -> tuple:
    """What a worker's three cache variables should be (written out case by case)."""
    mine = base.get("JAX_COMPILATION_CACHE_DIR")
    choice = base.get("JDIST_COMPILATION_CACHE", "")
    if mine or not enabled or choice.lower() in ("0", "off", "false", "no"):
        return tuple(base.get(k) for k in _VARS)
    if choice.startswith("/"):
        where = choice
    else:
        root = base.get("XDG_CACHE_HOME") or os.path.join(base["HOME"], ".cache")
        where = f"{root}/jdist/jax-compilation-cache/{_HOST}"
    return (where, base.get(_VARS[1], "0"), base.get(_VARS[2], "-1"))


_CASES = [
    ({}, True), ({}, False), ({"XDG_CACHE_HOME": "/xdg"}, True),
    ({"JAX_COMPILATION_CACHE_DIR": "/mine"}, True),
    ({"JAX_COMPILATION_CACHE_DIR": "/mine", _VARS[1]: "2"}, True),
    ({_VARS[1]: "1.5"}, True), ({_VARS[2]: "4096"}, True),
    ({"JDIST_COMPILATION_CACHE": "0"}, True), ({"JDIST_COMPILATION_CACHE": "OFF"}, True),
    ({"JDIST_COMPILATION_CACHE": "1"}, True), ({"JDIST_COMPILATION_CACHE": "/elsewhere"}, True),
    ({"JDIST_COMPILATION_CACHE": "/elsewhere"}, False),
]


@pytest.mark.parametrize(("extra", "enabled"), _CASES)
@pytest.mark.parametrize("local_rank", [0, 1])
def test_worker_cache_variables(extra, enabled, local_rank):
    base = {"HOME": "/home/u", **extra}
    env = worker_env(base, _JOB, local_rank, None, compilation_cache=enabled)
    assert tuple(env.get(k) for k in _VARS) == _expected(base, enabled)


_JOBFILE = """\
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    import optax
    from flax import nnx
    import jdist
    from jdist.ddp import DistributedDataParallel
    jdist.init_process_group()
    r = jdist.get_rank()
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))  # rank-local programs (key set-up, init)
    ddp = DistributedDataParallel(model)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = ddp.train_step(lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), opt)
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 7 + r
    losses = [float(step((x, np.ones((4, 2), np.float32)))) for _ in range(2)]
    local = float(jax.jit(lambda v: jnp.tanh(v).sum() * (r + 1))(jnp.arange(5.0)))
    summed = jdist.all_reduce(np.array([1.5 + r], np.float32)).tolist()
    print("CACHE " + json.dumps({
        "rank": r, "losses": losses, "local": local, "summed": summed,
        "kernel": np.asarray(model.kernel[...]).tolist(),
        "requests": events.count("/jax/compilation_cache/compile_requests_use_cache"),
        "hits": events.count("/jax/compilation_cache/cache_hits")}), flush=True)
"""


def _run_job(script: str, env: dict) -> dict:
    res = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                          "--devices-per-proc", "1",
                          script], env=env, capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    out = {}
    for line in res.stdout.splitlines():
        if "] CACHE " in line:
            rep = json.loads(line.split("] CACHE ", 1)[1])
            out[rep.pop("rank")] = rep
    assert sorted(out) == [0, 1], res.stdout[-2000:]
    return out


def test_a_warm_rerun_loads_every_program_on_every_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_JOBFILE))
    env = {k: v for k, v in os.environ.items()
           if k not in _VARS and k not in ("JDIST_AUTH_TOKEN", "JDIST_COMPILATION_CACHE")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p),
               XDG_CACHE_HOME=str(tmp_path / "xdg"))
    cold = _run_job(str(script), env)
    cache = tmp_path / "xdg" / "jdist" / "jax-compilation-cache" / _HOST
    entries = sorted(p.name for p in cache.iterdir())
    assert entries and not [e for e in entries if e.startswith(".jdist-entry-")]
    warm = _run_job(str(script), env)
    for rank in (0, 1):
        assert cold[rank]["hits"] == 0 and cold[rank]["requests"] > 0, cold
        # every program of every rank came from the cache: none compiled again
        assert warm[rank]["hits"] == warm[rank]["requests"] == cold[rank]["requests"], warm
        for k in ("losses", "local", "summed", "kernel"):
            assert warm[rank][k] == cold[rank][k], (rank, k)
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing new to write
    assert cold[0]["kernel"] == cold[1]["kernel"]  # DDP kept the replicas equal
