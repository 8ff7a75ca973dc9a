"""Train a digit classifier with jdist's DataParallel over all local devices.

The torch recipe ``model = nn.DataParallel(model)`` becomes ``dp = DataParallel(model)``:
every step scatters the batch over the devices (``torch.chunk`` sizes: 100 rows over 8
devices give 7 chunks of 13 and one of 9), runs the replicas with equal chunks as one
compiled program plus one for the last chunk, gathers the logits on device 0, and
``nnx.grad`` differentiates through all of it. BatchNorm statistics are replica 0's, as
in torch. The data is scikit-learn's bundled 8x8 digits (no download).

``--fused`` trains with ``dp.value_and_grad(loss)`` instead: forward, loss and backward
as ONE compiled program over the devices (same numbers, less dispatch).

On a CPU-only machine the devices are virtual (``--devices``, default 8) and share the
cores, so this shows the API, not a speedup.

  python examples/data_parallel.py [--epochs 8] [--batch 100] [--devices 8] [--fused]
                                   [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _setup(devices: int) -> None:
    if "jax" in sys.modules:  # already configured (e.g. under pytest)
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jdist.launch import xla_flags_with_devices  # imports no JAX

    os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices)


def _digits(np):
    """scikit-learn's bundled 8x8 digits, read from its data file (importing sklearn is slow)."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("this example needs scikit-learn (pip install scikit-learn)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data",
                        "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return data[:, :-1] / 16.0, data[:, -1].astype(np.int32)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="DataParallel digits classifier")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--devices", type=int, default=8, help="virtual CPU devices (CPU only)")
    ap.add_argument("--fused", action="store_true",
                    help="dp.value_and_grad: the whole step as one compiled program")
    ap.add_argument("--smoke", action="store_true", help="a few steps, for tests")
    args = ap.parse_args(argv)
    _setup(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jdist.dp import DataParallel

    x_all, y_all = _digits(np)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x_all))
    n_test = 297
    test, train = order[:n_test], order[n_test:]
    epochs, steps_cap = (1, 3) if args.smoke else (args.epochs, None)

    class Classifier(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(64, 128, rngs=rngs)
            self.norm = nnx.BatchNorm(128, rngs=rngs)
            self.out = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.norm(self.hidden(x))))

    model = nnx.jit(lambda: Classifier(nnx.Rngs(0)))()  # one compiled init, not op by op
    dp = DataParallel(model)
    print(f"DataParallel over {len(dp.device_ids)} devices: "
          f"{[str(d) for d in dp.device_ids]}, output on {dp.output_device}")
    optimizer = nnx.Optimizer(dp, optax.adam(args.lr), wrt=nnx.Param)

    cross_entropy = jax.jit(
        lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())

    def loss_fn(model, x, y):
        return cross_entropy(model(x), y)  # logits gathered on dp.output_device

    if args.fused:  # one program: scatter, replicas, gather, loss, backward, reduce-add
        fused = dp.value_and_grad(
            lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())
        grad_fn = lambda dp, x, y: fused(x, y)  # noqa: E731
    else:  # eager: DataParallel places the work on devices, nnx differentiates through it
        grad_fn = nnx.value_and_grad(loss_fn)
    update = nnx.jit(lambda opt, model, grads: opt.update(model, grads))
    history = []
    for epoch in range(epochs):
        dp.train()
        perm = rng.permutation(train)
        t0, losses = time.perf_counter(), []
        for step, start in enumerate(range(0, len(perm), args.batch)):
            if steps_cap is not None and step >= steps_cap:
                break
            idx = perm[start:start + args.batch]
            loss, grads = grad_fn(dp, jnp.asarray(x_all[idx]), jnp.asarray(y_all[idx]))
            update(optimizer, dp, grads)
            losses.append(float(loss))
        dp.eval()
        logits = dp(jnp.asarray(x_all[test]))
        acc = float(np.mean(np.argmax(np.asarray(logits), -1) == y_all[test]))
        history.append({"epoch": epoch, "loss": float(np.mean(losses)), "test_acc": acc})
        print(f"epoch {epoch + 1}/{epochs}  steps {len(losses)}  "
              f"train loss {np.mean(losses):.4f}  test acc {acc:.3f}  "
              f"({time.perf_counter() - t0:.2f} s)", flush=True)
    return {"history": history, "devices": len(dp.device_ids)}


if __name__ == "__main__":
    main()
