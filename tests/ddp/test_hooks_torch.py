"""Cross-framework: torch's own PowerSGD hook on the same model (single-process gloo DDP).

torch's ``PowerSGDState.compression_stats()`` after real DDP training must give the same
compression ratio as jdist's state for the same parameter shapes, and torch's rank-1
PowerSGD loss stays within 10% of its uncompressed loss, as jdist's does
(``test_hooks_ddp.py``).

torch's side runs in a child process that leaves with ``os._exit`` once it has printed
its numbers: torch 2.13's ``ProcessGroupGloo`` destructor now and then hangs joining
its threads when the DDP module holding it is freed (seen in CI, inside this test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from jdist.ddp import hooks as H
from tests.ddp.test_hooks_ddp import HELD_OUT, SIZES, teacher

AXIS = "dp"


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torch_train(tmp_path, hook_state_kw=None, steps=200, keep=None):
    """torch DDP training on one gloo rank; the held-out loss and the PowerSGD state.
    ``keep``: a list the DDP module is appended to (never freed: see the docstring)."""
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:], strict=False)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    store = dist.FileStore(str(tmp_path / f"store{bool(hook_state_kw)}"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if keep is not None:
            keep.append(ddp)
        state = None
        if hook_state_kw is not None:
            state = torch_psgd.PowerSGDState(process_group=None, **hook_state_kw)
            ddp.register_comm_hook(state, torch_psgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        rng = np.random.RandomState(0)
        for _ in range(steps):
            batch = {k: torch.from_numpy(v) for k, v in teacher(rng, 256).items()}
            opt.zero_grad()
            loss = torch.mean((ddp(batch["x"]) - batch["y"]) ** 2)
            loss.backward()
            opt.step()
        with torch.no_grad():
            held = {k: torch.from_numpy(v) for k, v in HELD_OUT.items()}
            full = float(torch.mean((model(held["x"]) - held["y"]) ** 2))
        return full, state
    finally:
        dist.destroy_process_group()


def jdist_stats(**kw):
    """jdist's stats for the same parameters (one bucket, flax kernel shapes (in, out))."""
    shapes = []
    for a, b in zip(SIZES, SIZES[1:], strict=False):
        shapes += [(a, b), (b,)]
    grads = [jax.ShapeDtypeStruct(s, np.float32) for s in reversed(shapes)]
    bucket = H.GradBucket(0, jax.ShapeDtypeStruct((sum(int(np.prod(s)) for s in shapes),),
                                                  np.float32),
                          tuple(grads), tuple(map(str, range(len(grads)))), True, AXIS, 8)
    state = H.init_hook_state(H.powerSGD_hook, H.PowerSGDState(**kw), [bucket])
    return state.compression_stats()


_CHILD = """
import json, os, pathlib, sys
from tests.ddp.test_hooks_torch import torch_train
keep, tmp = [], pathlib.Path(sys.argv[1])
plain, _ = torch_train(tmp, keep=keep)
compressed, state = torch_train(tmp, dict(start_powerSGD_iter=10), keep=keep)
print("RESULT " + json.dumps([plain, compressed, list(state.compression_stats())]),
      flush=True)
os._exit(0)  # no teardown of torch's process groups (see the module docstring)
"""


def torch_results(tmp_path):
    """``(plain loss, PowerSGD loss, torch's compression_stats())`` from a child."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    plain, compressed, stats = json.loads(lines[-1][len("RESULT "):])
    return plain, compressed, stats


def test_torch_powersgd_same_ratio_and_comparable_loss(tmp_path):
    plain, compressed, (t_rate, t_before, t_after) = torch_results(tmp_path)
    rate, before, after = jdist_stats(start_powerSGD_iter=10)
    # torch accumulates counts over the 190 compressed steps; the ratio is per step
    assert t_before == before * 190 and t_after == after * 190
    np.testing.assert_allclose(rate, t_rate, rtol=1e-12)
    assert abs(compressed - plain) <= 0.10 * plain, (compressed, plain)
    # and the criterion itself agrees with torch's on a grid, rank 1..4, rates 0.5..4
    for n in (1, 3, 8, 64):
        for m in (1, 5, 64, 300):
            for r in (1, 2, 4):
                for rate_ in (0.5, 2, 4):
                    assert H.should_compress(n, m, r, rate_) == torch_psgd._should_compress(
                        n, m, r, rate_)
