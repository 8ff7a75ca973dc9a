"""torchft's wrappers for Flax NNX: a DDP whose gradients are averaged over the
quorum, an optimizer whose step applies only when the quorum committed, and a sampler
that hands out every sample of an epoch exactly once across membership changes.

Each registers its state with the :class:`~jdist.ft.Manager`, so a replica that joins
heals parameters, optimizer state and the sampler's position from a live peer. With
``manager=None`` they are a plain single replica (e.g. to replay a ledger).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.collectives.runtime import uncommitted
from jdist.errors import FtError
from jdist.ft._manager import Manager
from jdist.ft._rounds import Quorum
from jdist.ft._rules import split_counts
from jdist.ft._state import to_numpy
from jdist.sampler import epoch_order

__all__ = ["DistributedDataParallel", "Optimizer", "DistributedSampler"]


def _count(batch) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves or not np.ndim(leaves[0]):
        raise FtError(f"the batch must hold arrays with a leading sample dimension, got "
                      f"{type(batch).__name__}")
    return int(np.shape(leaves[0])[0])


class DistributedDataParallel:
    """``module``'s gradients, averaged over the quorum's replicas by sample count."""

    def __init__(self, manager: Manager | None, module: nnx.Module):
        self.manager, self.module = manager, module
        self._local: dict[tuple[Any, bool], Any] = {}
        if manager is not None:
            manager.register_state("model", lambda: nnx.state(module),
                                   lambda s: nnx.update(module, s))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def local_value_and_grad(self, loss_fn, has_aux: bool = False):
        """The compiled ``(module, batch) -> (loss, grads)`` of this replica alone."""
        key = (loss_fn, has_aux)
        if key not in self._local:
            grad_fn = nnx.value_and_grad(loss_fn, has_aux=has_aux)
            self._local[key] = nnx.jit(lambda module, batch: grad_fn(module, batch))
        return self._local[key]

    def value_and_grad(self, loss_fn, has_aux: bool = False):
        """``f(batch) -> (loss, grads)``: ``loss_fn(module, batch)`` on this replica's
        batch, gradients averaged over the quorum (a replica with an empty batch adds
        nothing). After a failure in the step the local gradients come back, and the
        step does not commit."""
        local = self.local_value_and_grad(loss_fn, has_aux)

        def step(batch):
            n = _count(batch)
            if n:
                value, grads = local(self.module, batch)
            else:
                value = jnp.nan
                grads = jax.tree.map(jnp.zeros_like, nnx.state(self.module, nnx.Param))
            if self.manager is None:
                return value, grads
            leaves, treedef = jax.tree.flatten(grads)
            mean = self.manager.allreduce([to_numpy(x) for x in leaves], n)
            # (the mean's fresh, aligned arrays: placed without a copy or device_put)
            return value, jax.tree.unflatten(treedef, [uncommitted(m) for m in mean])

        return step


@functools.cache
def _update_program(graphdef):
    """The compiled update of one (optimizer, model) structure, on split state (an
    ``nnx.jit`` would walk both object graphs on every call: ~2 ms a step here)."""
    def run(state, grads):
        optimizer, model = nnx.merge(graphdef, state)
        optimizer.update(model, grads)
        return nnx.state((optimizer, model))

    return jax.jit(run)


def _update(optimizer, model, grads) -> None:
    graphdef, state = nnx.split((optimizer, model))
    nnx.update((optimizer, model), _update_program(graphdef)(state, grads))


class Optimizer:
    """An ``nnx.Optimizer`` that steps only when the quorum committed."""

    def __init__(self, manager: Manager | None, optimizer: nnx.Optimizer):
        self.manager, self.optimizer = manager, optimizer
        if manager is not None:
            manager.register_state("optimizer", lambda: nnx.state(optimizer),
                                   lambda s: nnx.update(optimizer, s))

    def zero_grad(self) -> Quorum | None:
        """Start the step: join the quorum (and heal). torch's idiom, torchft's hook."""
        return None if self.manager is None else self.manager.start_quorum()

    def apply(self, model: nnx.Module, grads) -> None:
        """Apply ``grads`` unconditionally (what :meth:`step` does after a commit)."""
        _update(self.optimizer, model, grads)

    def step(self, model: nnx.Module, grads) -> bool:
        """Apply ``grads`` if every replica of the quorum succeeded; returns whether."""
        if self.manager is not None and not self.manager.should_commit():
            return False
        self.apply(model, grads)
        return True


class DistributedSampler:
    """Exactly-once samples per epoch over any sequence of quorums.

    The epoch's order is torch's (``randperm`` after ``seed + epoch``, or ``arange``).
    Each step the quorum takes the next ``members * batch_size`` indices (fewer at the
    epoch's end), member ``i`` the ``i``-th slice; the position moves only when the
    step commits, and a joining replica heals it. ``ledger`` (a path) gets one JSON
    line per committed step with this replica's indices.
    """

    def __init__(self, manager: Manager | None, dataset, batch_size: int, *,
                 shuffle: bool = True, seed: int = 0, ledger: str | None = None):
        self.size = dataset if isinstance(dataset, int) else len(dataset)
        if self.size < 1 or batch_size < 1:
            raise FtError(f"need a non-empty dataset and batch_size >= 1, got {self.size} "
                          f"samples and batch_size={batch_size}")
        self.manager, self.batch_size = manager, int(batch_size)
        self.shuffle, self.seed, self.ledger = shuffle, int(seed), ledger
        self.epoch, self.cursor = 0, 0
        self._ordered: tuple = (None, None)  # ((epoch, seed, shuffle), its order)
        if manager is not None:
            manager.register_state("sampler", self.state_dict, self.load_state_dict)
            manager.on_commit(self._committed)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    def take(self, members: int, rank: int) -> np.ndarray:
        """The indices member ``rank`` of ``members`` gets at the current position."""
        counts = split_counts(self.size - self.cursor, members, self.batch_size)
        start = self.cursor + sum(counts[:rank])
        return self._order()[start:start + counts[rank]]

    def _order(self) -> np.ndarray:
        """The current epoch's order, computed once per epoch (a permutation of the
        whole dataset: not per step)."""
        if self._ordered[0] != (self.epoch, self.seed, self.shuffle):
            self._ordered = ((self.epoch, self.seed, self.shuffle),
                             epoch_order(self.size, shuffle=self.shuffle, seed=self.seed,
                                         epoch=self.epoch))
        return self._ordered[1]

    def advance(self, members: int) -> None:
        """Move past one step of ``members`` replicas."""
        self.cursor += sum(split_counts(self.size - self.cursor, members, self.batch_size))
        if self.cursor >= self.size:
            self.epoch, self.cursor = self.epoch + 1, 0

    def indices(self) -> np.ndarray:
        """This replica's indices for the current step (after ``zero_grad``)."""
        if self.manager is None:
            return self.take(1, 0)
        return self.take(self.manager.num_participants(), self.manager.participant_rank())

    def _committed(self, q: Quorum) -> None:
        if self.ledger is not None:
            line = {"step": self.manager.current_step(), "epoch": self.epoch,
                    "cursor": self.cursor,
                    "replica": self.manager.replica_id, "members": list(q.members),
                    "inc": q.incarnations.get(self.manager.replica_id, 0),
                    "indices": self.take(len(q.members),
                                         q.rank(self.manager.replica_id)).tolist()}
            with open(self.ledger, "a") as f:
                f.write(json.dumps(line) + "\n")
        self.advance(len(q.members))
