"""An RPC policy server (jdist): observers ask an agent for actions by RPC.

Our own program in the pattern of torch's RL-over-RPC tutorial (not a copy of it): rank 0
is the agent, holding a policy MLP (4 -> 128 -> 2) and an optax optimizer; ranks 1.. are
observers, each stepping a small numpy environment and calling the agent's
``select_action`` by ``rpc_sync`` for every step. The agent keeps each observer's
log-probabilities and rewards and, after every episode, the observers ask it to
``finish_episode``: one REINFORCE update over the episode::

    jdist-run --nproc-per-node 3 examples/ports/rpc_policy.py --smoke

The lines a torch user changes: the policy in NNX, held as its split state
(``select_action`` runs on several RPC threads at once, and an NNX transform on one
module from two threads is not thread-safe); ``select_action`` runs the policy and
samples as one ``jax.jit`` program (from a uniform number the observer draws, so both
runs sample alike); the episode's log-probabilities are recomputed in the update from
the kept observations and actions (a JAX array keeps no graph), one jitted
``value_and_grad`` and optax step. The time of a step is the observer's
``select_action`` round trip.
"""

from __future__ import annotations

import argparse
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import save
from _data import discounted_returns, observe
from flax import nnx

from jdist import rpc

AGENT = "agent"


class Policy(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(4, 128, rngs=rngs)
        self.l2 = nnx.Linear(128, 2, rngs=rngs)

    def __call__(self, x):
        return jax.nn.log_softmax(self.l2(nnx.relu(self.l1(x))), axis=-1)


@jax.jit
def act(params, obs, u):
    """One action, sampled by inverting the CDF at ``u`` (shared with the twin)."""
    p1 = jnp.exp(nnx.merge(GRAPH, params)(obs[None])[0, 1])
    return (u < p1).astype(jnp.int32)


@jax.jit
def update(params, opt_state, obs, actions, returns):
    def loss(p):
        logp = jnp.take_along_axis(nnx.merge(GRAPH, p)(obs), actions[:, None], 1)[:, 0]
        return -jnp.sum(logp * returns)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


GRAPH, _PARAMS = nnx.split(Policy())
TX = optax.adam(1e-2)


class Agent:
    """The policy as a pytree of parameters (``nnx.split``): select_action runs on
    several RPC threads at once, and an NNX transform on one module from two threads
    is not thread-safe; a pure function of the state is, and an update replaces the
    state in one assignment."""

    def __init__(self, gamma: float = 0.99):
        self.params = _PARAMS
        self.opt_state = TX.init(self.params)
        self.gamma = gamma
        self.lock = threading.Lock()
        self.episodes: dict[int, list] = {}

    def select_action(self, observer: int, obs: np.ndarray, u: float) -> int:
        action = int(act(self.params, jnp.asarray(obs, jnp.float32), u))
        self.episodes.setdefault(observer, []).append((obs, action))
        return action

    def finish_episode(self, observer: int, rewards: list) -> float:
        steps = self.episodes.pop(observer)
        returns = discounted_returns(rewards, self.gamma)
        obs = np.stack([o for o, _ in steps]).astype(np.float32)
        actions = np.asarray([a for _, a in steps], np.int32)
        with self.lock:
            self.params, self.opt_state, value = update(self.params, self.opt_state, obs,
                                                        actions, returns)
        return float(value)


_agent: Agent | None = None


def select_action(observer: int, obs: np.ndarray, u: float) -> int:
    return _agent.select_action(observer, obs, u)


def finish_episode(observer: int, rewards: list) -> float:
    return _agent.finish_episode(observer, rewards)


def main():
    p = argparse.ArgumentParser(description="RPC policy server (REINFORCE)")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--steps", type=int, default=100, help="steps per episode")
    p.add_argument("--smoke", action="store_true", help="2 episodes of 20 steps")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.episodes, args.steps = 2, 20
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size < 2:
        raise SystemExit(f"rpc_policy needs an agent and an observer, got WORLD_SIZE="
                         f"{world_size}; run with jdist-run --nproc-per-node 2 or more")
    global _agent
    if rank == 0:
        _agent = Agent()
    rpc.init_rpc(AGENT if rank == 0 else f"observer{rank}", rank=rank, world_size=world_size)
    result = {} if rank == 0 else observe(rpc.rpc_sync, select_action, finish_episode,
                                          rank, args.episodes, args.steps)
    rpc.shutdown()
    if rank == 0:
        result = {"params": {k: np.asarray(v) for k, v in
                             nnx.State(_agent.params).flat_state()}}
    save(args.out, rank, result)


if __name__ == "__main__":
    main()
