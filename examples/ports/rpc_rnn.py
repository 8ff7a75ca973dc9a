"""An RNN split over a parameter server (jdist): embedding and decoder are remote
modules, the LSTM runs on the trainer.

Our own program in the pattern of torch's distributed RNN tutorial (not a copy of it):
rank 0 ("ps") owns an ``Embed`` and a ``Linear`` decoder, built there by
``RemoteModule``; rank 1 ("trainer") holds an LSTM and trains all three with
distributed autograd and a ``DistributedOptimizer`` on a next-token task::

    jdist-run --nproc-per-node 2 examples/ports/rpc_rnn.py --smoke

The lines a torch user changes: the layers in NNX (``nnx.Embed``, ``nnx.Linear``,
``nnx.RNN(nnx.OptimizedLSTMCell)``); ``dist_autograd.backward(cid, loss_fn, ...)`` runs
the forward pass; ``RRef(lstm)`` for the local module's parameters; ``optax.sgd`` with
``learning_rate=``; ``loss_fn`` marked ``@dist_autograd.pure``, so from its second pass
the whole step (the RPCs as host callbacks, the LSTM's scan and its backward pass, the
LSTM's gradients) is one compiled program (unmarked, the eager path traces the scan
again every step: about 14x slower here). The time of a step is the trainer's context,
backward and optimizer step.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import optax
from _common import save
from _data import token_batches
from flax import nnx

from jdist import rpc
from jdist.rpc import DistributedOptimizer, RemoteModule, RRef, dist_autograd

VOCAB, EMB, HIDDEN = 64, 32, 64


def make_embedding():
    return nnx.Embed(VOCAB, EMB, rngs=nnx.Rngs(1))


def make_decoder():
    return nnx.Linear(HIDDEN, VOCAB, rngs=nnx.Rngs(2))


class RNNModel:
    def __init__(self):
        self.emb = RemoteModule("ps/cpu", make_embedding)
        self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(EMB, HIDDEN, rngs=nnx.Rngs(3)))
        self.decoder = RemoteModule("ps/cpu", make_decoder)

    def parameter_rrefs(self):
        return (self.emb.remote_parameters() + [RRef(self.rnn)]
                + self.decoder.remote_parameters())


@dist_autograd.pure
def loss_fn(model, rnn, tokens, targets):
    x = model.emb(tokens)                  # (batch, time, EMB), by RPC
    h = rnn(x)                             # (batch, time, HIDDEN), here
    logits = model.decoder(h)              # by RPC
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def train(steps: int) -> dict:
    model = RNNModel()
    opt = DistributedOptimizer(optax.sgd, model.parameter_rrefs(), learning_rate=0.5)
    losses, times = [], []
    for i, (tokens, targets) in enumerate(token_batches(steps, VOCAB)):
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            loss = dist_autograd.backward(cid, loss_fn, model, model.rnn, tokens, targets)
            opt.step(cid)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if i % 10 == 0:
            print(f"step {i} loss {losses[-1]:.4f}", flush=True)
    return {"losses": losses, "times": times}


def main():
    p = argparse.ArgumentParser(description="RNN over a parameter server (RPC)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--smoke", action="store_true", help="6 steps")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.steps = 6
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != 2:
        raise SystemExit(f"rpc_rnn runs a ps and a trainer, got WORLD_SIZE={world_size}; "
                         "run with jdist-run --nproc-per-node 2")
    rpc.init_rpc("ps" if rank == 0 else "trainer", rank=rank, world_size=world_size)
    result = train(args.steps) if rank == 1 else {}
    rpc.shutdown()
    save(args.out, rank, result)


if __name__ == "__main__":
    main()
