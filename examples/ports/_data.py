"""Synthetic data of the ported programs, from numpy seeds (no JAX, no torch).

The originals draw with ``torch.randn``/``random`` or download MNIST/ImageNet-sized
inputs; the ports and their torch twins read these instead, so both see the same
batches.
"""

from __future__ import annotations

import numpy as np


def toy_batch(rank: int, step: int, size: int = 20):
    """ddp/example.py: one rank's (inputs (size, 10), labels (size, 5)) of one step."""
    rs = np.random.RandomState(1000 * rank + step)
    return rs.randn(size, 10).astype(np.float32), rs.randn(size, 5).astype(np.float32)


def tutorial_dataset(size: int = 2048, seed: int = 0):
    """ddp-tutorial-series ``MyTrainDataset``: ``size`` pairs (x in [0,1)^20, y in [0,1))."""
    rs = np.random.RandomState(seed)
    return rs.rand(size, 20).astype(np.float32), rs.rand(size, 1).astype(np.float32)


def digits(n_test: int = 297):
    """scikit-learn's bundled 8x8 digits (no download) as NCHW float32 images in [0, 1]
    and int64 labels: ``(x_train, y_train, x_test, y_test)``, the last ``n_test`` of a
    seeded shuffle being the test set (MNIST in the originals)."""
    import gzip
    import importlib.util
    import os

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("this example needs scikit-learn (pip install scikit-learn)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data",
                        "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = (data[:, :-1].reshape(-1, 1, 8, 8) / 16.0 - 0.5).astype(np.float32)
    y = data[:, -1].astype(np.int64)
    order = np.random.RandomState(0).permutation(len(x))
    train, test = order[:-n_test], order[-n_test:]
    return x[train], y[train], x[test], y[test]


def shuffled_batches(n: int, batch_size: int, seed: int, steps: int | None = None):
    """Index batches of one shuffled pass over ``n`` rows (a DataLoader with
    ``shuffle=True``), the last one shorter; at most ``steps`` of them."""
    order = np.random.RandomState(seed).permutation(n)
    out = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    return out if steps is None else out[:steps]


def batch_ps_trainer_data(rank: int, num_batches: int, batch_size: int = 20,
                          num_classes: int = 10, image_hw: int = 8):
    """rpc/batch: trainer ``rank``'s batches of (NCHW images, one-hot labels); the
    label indices are fixed per trainer, as the original's ``one_hot_indices``."""
    rs = np.random.RandomState(100 + rank)
    hot = rs.randint(0, num_classes, size=batch_size)
    labels = np.zeros((batch_size, num_classes), np.float32)
    labels[np.arange(batch_size), hot] = 1
    return [(rs.randn(batch_size, 3, image_hw, image_hw).astype(np.float32), labels)
            for _ in range(num_batches)]


def hybrid_batches(rank: int, epoch: int, num_batches: int = 10,
                   num_embeddings: int = 100, num_classes: int = 8):
    """rpc/ddp_rpc: one epoch of a trainer's variable-size bags (the original's
    ``get_next_batch``, seeded): 20..50 indices cut into bags of 1..10 at ``offsets``,
    one target class per bag."""
    rs = np.random.RandomState(10000 * rank + epoch)
    for _ in range(num_batches):
        num_indices = rs.randint(20, 51)
        indices = rs.randint(0, num_embeddings, size=num_indices).astype(np.int64)
        offsets, start = [], 0
        while start < num_indices:
            offsets.append(start)
            start += rs.randint(1, 11)
        target = rs.randint(0, num_classes, size=len(offsets)).astype(np.int64)
        yield indices, np.asarray(offsets, np.int64), target


def pipeline_batches(num_batches: int, batch_size: int, num_classes: int = 10,
                     image_hw: int = 8, seed: int = 0):
    """rpc/pipeline: (NCHW images, one-hot labels); the label indices are drawn once,
    as the original's ``one_hot_indices``."""
    rs = np.random.RandomState(seed)
    hot = rs.randint(0, num_classes, size=batch_size)
    labels = np.zeros((batch_size, num_classes), np.float32)
    labels[np.arange(batch_size), hot] = 1
    return [(rs.randn(batch_size, 3, image_hw, image_hw).astype(np.float32), labels)
            for _ in range(num_batches)]


class ToyEnv:
    """A cart-pole-like environment in numpy (no gym): 4 numbers of state, two actions;
    the reward is 1 while the pole stays up. Deterministic per seed."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.state = np.zeros(4)

    def reset(self) -> np.ndarray:
        self.state = self.rng.uniform(-0.05, 0.05, 4)
        return self.state.astype(np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float]:
        x, v, theta, omega = self.state
        force = 1.0 if action == 1 else -1.0
        omega = omega + 0.02 * (9.8 * np.sin(theta) - force * np.cos(theta))
        theta = theta + 0.02 * omega
        v = v + 0.02 * force
        x = x + 0.02 * v
        self.state = np.array([x, v, theta, omega])
        reward = 1.0 if abs(theta) < 0.21 else 0.0
        if reward == 0.0:  # fallen: start over, as an episode of fixed length goes on
            self.state = self.rng.uniform(-0.05, 0.05, 4)
        return self.state.astype(np.float32), reward


def token_batches(steps: int, vocab: int, batch: int = 16, length: int = 20, seed: int = 0):
    """``(tokens, targets)`` int64 batches of a next-token task: each sequence counts up
    by a random stride modulo ``vocab``, the targets are the next tokens."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, vocab, (batch, 1))
        stride = rng.integers(1, 4, (batch, 1))
        seq = (start + stride * np.arange(length + 1)) % vocab
        yield seq[:, :-1].astype(np.int64), seq[:, 1:].astype(np.int64)


def discounted_returns(rewards: list, gamma: float) -> np.ndarray:
    """REINFORCE's returns of an episode, normalized (mean 0, std 1), float32."""
    ret, out = 0.0, []
    for r in reversed(rewards):
        ret = r + gamma * ret
        out.insert(0, ret)
    out = np.asarray(out, np.float32)
    return (out - out.mean()) / (out.std() + 1e-6)


def observe(rpc_sync, select_action, finish_episode, rank: int, episodes: int,
            steps: int, agent: str = "agent") -> dict:
    """An observer of the policy-server programs: steps a ``ToyEnv``, asking the agent
    for each action by ``rpc_sync`` (timed), and ends each episode with
    ``finish_episode``. ``rpc_sync`` is jdist's or torch's."""
    import time

    env = ToyEnv(seed=rank)
    rng = np.random.default_rng(100 + rank)
    times, losses, total = [], [], 0.0
    for _ in range(episodes):
        obs, rewards = env.reset(), []
        for _ in range(steps):
            t0 = time.perf_counter()
            action = rpc_sync(agent, select_action, args=(rank, obs, float(rng.random())))
            times.append(time.perf_counter() - t0)
            obs, reward = env.step(action)
            rewards.append(reward)
        total += sum(rewards)
        losses.append(rpc_sync(agent, finish_episode, args=(rank, rewards)))
    print(f"observer {rank}: {episodes} episodes, mean reward {total / episodes:.2f}",
          flush=True)
    return {"times": times, "losses": losses}
