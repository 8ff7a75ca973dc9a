"""The torch twin of ``rpc_policy.py``: the same agent and observers in torch's RPC
(the update recomputes the episode's log-probabilities under the lock: a graph kept
from ``select_action`` is stale once another observer's update changed the weights)::

    torchrun --nproc-per-node 3 examples/ports/rpc_policy_torch.py --smoke
"""

from __future__ import annotations

import argparse
import os
import threading

import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from _common import save
from _data import discounted_returns, observe

AGENT = "agent"


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 128)
        self.l2 = nn.Linear(128, 2)

    def forward(self, x):
        return F.log_softmax(self.l2(F.relu(self.l1(x))), dim=-1)


class Agent:
    def __init__(self, gamma: float = 0.99):
        torch.manual_seed(0)
        self.policy = Policy()
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.gamma = gamma
        self.lock = threading.Lock()
        self.episodes: dict[int, list] = {}

    def select_action(self, observer: int, obs: np.ndarray, u: float) -> int:
        with torch.no_grad():
            logp = self.policy(torch.from_numpy(obs).float()[None])[0]
        action = int(u < float(logp[1].exp()))
        self.episodes.setdefault(observer, []).append((obs, action))
        return action

    def finish_episode(self, observer: int, rewards: list) -> float:
        steps = self.episodes.pop(observer)
        returns = torch.from_numpy(discounted_returns(rewards, self.gamma))
        obs = torch.from_numpy(np.stack([o for o, _ in steps])).float()
        actions = torch.tensor([a for _, a in steps])
        with self.lock:  # the log-probabilities of this policy (another update may be past)
            self.opt.zero_grad()
            logp = self.policy(obs).gather(1, actions[:, None])[:, 0]
            loss = -(logp * returns).sum()
            loss.backward()
            self.opt.step()
        return float(loss)


_agent: Agent | None = None


def select_action(observer: int, obs: np.ndarray, u: float) -> int:
    return _agent.select_action(observer, obs, u)


def finish_episode(observer: int, rewards: list) -> float:
    return _agent.finish_episode(observer, rewards)


def main():
    p = argparse.ArgumentParser(description="RPC policy server (REINFORCE), torch")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--steps", type=int, default=100, help="steps per episode")
    p.add_argument("--smoke", action="store_true", help="2 episodes of 20 steps")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.episodes, args.steps = 2, 20
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    global _agent
    if rank == 0:
        _agent = Agent()
    rpc.init_rpc(AGENT if rank == 0 else f"observer{rank}", rank=rank, world_size=world_size)
    result = {} if rank == 0 else observe(rpc.rpc_sync, select_action, finish_episode,
                                          rank, args.episodes, args.steps)
    rpc.shutdown()
    if rank == 0:
        result = {"params": {k: v.detach().numpy() for k, v in
                             _agent.policy.state_dict().items()}}
    save(args.out, rank, result)


if __name__ == "__main__":
    main()
