"""``python -m jdist.testing.parity``: run a built-in torch/NNX model pair through the harness.

Prints the :class:`~jdist.testing.ParityReport` table and exits 0 when every loss,
parameter and running-statistic difference is within ``--tol``, 1 when one is above it
(2 for bad arguments)::

  python -m jdist.testing.parity --model cnn --steps 5 --optimizer adam --lr 1e-3
  python -m jdist.testing.parity --model mlp --nprocs 2 --tol 1e-5

``--perturb EPS`` adds ``EPS`` to the NNX model's first weight after the copy, to see
a failing run. The harness itself is :func:`jdist.testing.run_parity`; this module
re-exports it.
"""

from __future__ import annotations

import argparse
import functools
import sys

from jdist.testing._parity import run_parity as run_parity
from jdist.testing._parity_models import EXAMPLES as EXAMPLES
from jdist.testing._parity_models import TorchBatchNorm as TorchBatchNorm
from jdist.testing._parity_models import build_nnx_model as build_nnx_model
from jdist.testing._parity_models import build_torch_model as build_torch_model
from jdist.testing._parity_models import example as example
from jdist.testing._parity_pairs import OPTIMIZERS as OPTIMIZERS
from jdist.testing._parity_pairs import optimizer_spec as optimizer_spec
from jdist.testing._parity_report import ParityReport as ParityReport

__all__ = ["EXAMPLES", "OPTIMIZERS", "ParityReport", "TorchBatchNorm", "build_nnx_model",
           "build_torch_model", "example", "main", "optimizer_spec", "parser",
           "run_example", "run_parity"]


def parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        prog="python -m jdist.testing.parity",
        description="Train a built-in torch model and its Flax NNX port side by side and "
                    "report per-step losses and per-layer parameter differences.")
    p.add_argument("--model", choices=EXAMPLES, default="mlp")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999),
                   metavar=("B1", "B2"), help="Adam/AdamW betas")
    p.add_argument("--eps", type=float, default=1e-8, help="Adam/AdamW eps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=16, help="per process; 0: all data")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--nprocs", type=int, default=1,
                   help="processes per framework (>1: torch DDP and jdist DDP)")
    p.add_argument("--perturb", type=float, default=0.0,
                   help="add this to the NNX model's first weight after the copy")
    p.add_argument("--eval", action="store_true", help="eval mode instead of training mode")
    p.add_argument("--params-every-step", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (--nprocs > 1)")
    return p


def _perturbed_nnx(name: str, seed: int, eps: float):
    """The example's NNX model with ``eps`` added to its first weight after the copy."""
    import jax
    from flax import nnx

    from jdist.testing._convert import torch_to_nnx

    model = torch_to_nnx(build_torch_model(name, seed), build_nnx_model(name, seed))
    if eps:
        _, params, _ = nnx.split(model, nnx.Param, ...)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        leaves[0] = leaves[0] + eps
        nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
    return model


def run_example(name: str, optimizer, *, steps: int = 5, batch_size: int | None = 16,
                samples: int = 64, shuffle: bool = True, seed: int = 0, nprocs: int = 1,
                perturb: float = 0.0, train: bool = True, params_every_step: bool = False,
                timeout: float = 300.0) -> ParityReport:
    """Run built-in example ``name`` (see :data:`EXAMPLES`) through :func:`run_parity`."""
    ex = example(name, seed, samples)
    copy = not perturb
    if nprocs > 1:
        torch_model = functools.partial(build_torch_model, name, seed)
        nnx_model = (functools.partial(_perturbed_nnx, name, seed, perturb) if perturb
                     else functools.partial(build_nnx_model, name, seed))
    else:
        torch_model = ex.torch_model
        nnx_model = _perturbed_nnx(name, seed, perturb) if perturb else ex.nnx_model
    return run_parity(torch_model, nnx_model, ex.loss, ex.data, optimizer, steps=steps,
                      batch_size=batch_size, shuffle=shuffle, seed=seed,
                      jax_input=ex.jax_input, train=train, copy_weights=copy,
                      params_every_step=params_every_step, nprocs=nprocs, timeout=timeout)


def main(argv=None) -> int:
    """CLI entry: print the report table; return 0 within ``--tol``, 1 above it."""
    p = parser()
    a = p.parse_args(argv)
    if a.steps < 1 or a.nprocs < 1 or a.batch_size < 0 or a.samples < 1 or a.tol < 0:
        p.error("--steps, --nprocs and --samples must be >= 1, --batch-size and --tol >= 0")
    if a.optimizer == "sgd":
        spec = {"name": "sgd", "lr": a.lr, "momentum": a.momentum,
                "weight_decay": a.weight_decay}
    else:
        spec = {"name": a.optimizer, "lr": a.lr, "betas": tuple(a.betas), "eps": a.eps,
                "weight_decay": a.weight_decay}
    try:
        spec = optimizer_spec(spec)
    except ValueError as e:
        p.error(str(e))
    report = run_example(a.model, spec, steps=a.steps, batch_size=a.batch_size or None,
                         samples=a.samples, shuffle=not a.no_shuffle, seed=a.seed,
                         nprocs=a.nprocs, perturb=a.perturb, train=not a.eval,
                         params_every_step=a.params_every_step, timeout=a.timeout)
    print(f"model: {a.model}")
    print(report.table(tol=a.tol))
    return 0 if report.ok(a.tol) else 1


if __name__ == "__main__":
    sys.exit(main())
