"""Pipeline-parallel training with torch's schedules (jdist.pipelining).

An 8-layer MLP learns a random teacher network's outputs. ``pipeline`` groups the
layers into 4 stages, each on its own (virtual) device; a torch schedule (``--schedule``:
GPipe, 1F1B, LoopedBFS, Interleaved1F1B, InterleavedZeroBubble) runs the micro-batches;
each stage's optimizer steps on its own gradients.

    python examples/train_pipeline.py --schedule Interleaved1F1B --pp-size 2
"""

from __future__ import annotations

import argparse
import os
import sys


def _setup(devices: int) -> None:
    """Ask XLA for ``devices`` virtual CPU devices (one per stage)."""
    if "jax" in sys.modules:
        return  # configured already (pytest)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jdist.launch import xla_flags_with_devices  # imports no JAX

    os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--pp-size", type=int, default=None,
                    help="pipeline ranks the schedule lays the 4 stages over")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="a few steps, for tests")
    args = ap.parse_args(argv)
    _setup(4)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from tqdm import tqdm

    import jdist.pipelining as pp

    width, stages_n = 32, 4
    rng = np.random.default_rng(0)
    teacher = [rng.standard_normal((width, width)).astype(np.float32) / np.sqrt(width)
               for _ in range(2)]
    x_all = rng.standard_normal((1024, width)).astype(np.float32)
    y_all = np.tanh(np.tanh(x_all @ teacher[0]) @ teacher[1])

    rngs = nnx.Rngs(0)
    layers = [nnx.Sequential(nnx.Linear(width, width, rngs=rngs), jnp.tanh) for _ in range(8)]
    mods = pp.pipeline(layers, stages_n)
    devices = jax.devices()
    stages = [pp.PipelineStage(m, i, stages_n, device=devices[i % len(devices)])
              for i, m in enumerate(mods)]
    opts = [nnx.Optimizer(m, optax.adam(3e-3), wrt=nnx.Param) for m in mods]

    def loss_fn(out, target):
        return jnp.mean((out - target) ** 2)

    schedule = pp.get_schedule_class(args.schedule)(stages, args.microbatches,
                                                    loss_fn=loss_fn, pp_size=args.pp_size)
    steps = 5 if args.smoke else args.steps
    history = []
    bar = tqdm(range(steps), desc=f"{args.schedule} x {args.microbatches} micro-batches",
               dynamic_ncols=True)
    for _ in bar:
        idx = rng.integers(0, len(x_all), 64)
        losses: list = []
        schedule.step(x_all[idx], target=y_all[idx], losses=losses)
        for m, opt, st in zip(mods, opts, stages, strict=True):
            opt.update(m, st.grads)
        history.append(float(np.mean([float(v) for v in losses])))
        bar.set_postfix(loss=f"{history[-1]:.4f}")
    print(f"{args.schedule}: {stages_n} stages on {len({d for d in devices[:stages_n]})} "
          f"device(s), loss {history[0]:.4f} -> {history[-1]:.4f}")
    return {"history": history}


if __name__ == "__main__":
    main()
