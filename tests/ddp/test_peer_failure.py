"""A rank killed inside DDP training: the survivor's step raises PeerFailedError naming it.

Real processes: rank 1 runs as a grandchild of its spawned process (so that ``spawn``
does not end the job when it dies), trains two steps with the survivor and SIGKILLs
itself; the survivor keeps stepping and must get :class:`jdist.errors.PeerFailedError`
(a ``RuntimeError``, as torch's gloo error is) naming rank 1, well within the group
timeout, never JAX's raw "Gloo all-reduce failed" runtime error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers import run_procs

TIMEOUT = 30


def _ddp_step():
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel as DDP
    from tests.ddp.models import MLP, data, mse

    jdist.init_process_group(timeout=TIMEOUT)
    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model)
    step = ddp.train_step(mse, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    batch = data(n=8, seed=jdist.get_rank())
    for _ in range(2):
        float(step(batch))
    return step, batch


def _dying_rank() -> None:
    """Trains two steps with the survivor, then dies without a word (SIGKILL)."""
    _ddp_step()
    os.kill(os.getpid(), signal.SIGKILL)


def _survivor() -> dict:
    from jdist.errors import PeerFailedError

    step, batch = _ddp_step()
    t = time.monotonic()
    try:
        for _ in range(10_000):
            float(step(batch))
        return {"error": "no error", "type": None}
    except PeerFailedError as e:
        return {"error": str(e), "type": "PeerFailedError",
                "is_runtime_error": isinstance(e, RuntimeError),
                "seconds": time.monotonic() - t}
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        return {"error": f"{type(e).__name__}: {e}"[:2000], "type": type(e).__name__}


def _grandchild(fn: str) -> subprocess.CompletedProcess:
    code = (f"import json; from tests.ddp.test_peer_failure import {fn}; "
            f"print(json.dumps({fn}()), flush=True)")
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ), timeout=150,
                          capture_output=True, text=True)


def _survivor_or_victim() -> dict:
    if int(os.environ["RANK"]) == 1:
        return {"victim_exit": _grandchild("_dying_rank").returncode}
    return _survivor()


def test_killed_rank_inside_ddp_step_is_named():
    results = run_procs(_survivor_or_victim, 2, timeout=180)
    survivor = results[0]
    assert results[1]["victim_exit"] == -signal.SIGKILL, results
    assert survivor["type"] == "PeerFailedError", survivor
    assert survivor["is_runtime_error"], survivor
    assert "rank 1" in survivor["error"] and "DDP step" in survivor["error"], survivor
    assert "Look at that rank's own error first" in survivor["error"], survivor
    assert survivor["seconds"] < TIMEOUT, survivor
    print(survivor["error"])
