"""Resuming an epoch on another world size: the samples not yet consumed, re-split.

A :class:`~jdist.sampler.DistributedSampler` gives rank ``r`` of ``R`` positions
``r, r + R, r + 2R, ...`` of the epoch's order. When every rank has consumed ``c``
samples (ranks step together in data-parallel training), the consumed positions are
exactly the prefix ``[0, c * R)`` of that order. So the rest of an epoch is one
number, the *offset* into the epoch order: ``order[offset:]``, split over the new world
with the sampler's own rule (padding by repeating from the start of the rest, or
cutting the tail with ``drop_last``). Several resizes in one epoch add up their
prefixes.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from jdist.checkpoint._errors import CheckpointMismatchError
from jdist.sampler import epoch_order, shard_sequence

__all__ = ["ResumedSampler", "global_offset", "resume_sampler"]


def _length(sampler) -> int:
    d = sampler.dataset
    return int(d) if isinstance(d, (int, np.integer)) else len(d)


def global_offset(states: list[dict], name: str) -> int:
    """Positions of the current epoch's order that the saving world consumed.

    ``states`` are every saved rank's ``state_dict()``, in rank order.
    """
    epochs = {s["epoch"] for s in states}
    offsets = {s.get("offset", 0) for s in states}
    consumed = [s["consumed"] for s in states]
    if len(epochs) != 1 or len(offsets) != 1:
        raise CheckpointMismatchError(
            f"state[{name!r}]: the saved ranks' samplers are at different epochs "
            f"{sorted(epochs)} or offsets {sorted(offsets)}; cannot re-split the epoch")
    if len(set(consumed)) != 1:
        raise CheckpointMismatchError(
            f"state[{name!r}]: the saved ranks consumed different numbers of samples "
            f"{consumed}, so the consumed samples are not a prefix of the epoch order and "
            "the rest cannot be re-split for another world size; save after steps that "
            "every rank takes (the same batches per rank)")
    n = states[0]["dataset_length"]
    base = offsets.pop()
    return min(n, base + consumed[0] * len(states))


class ResumedSampler:
    """A :class:`~jdist.sampler.DistributedSampler` resumed mid-epoch on a new world.

    For its resumed epoch it yields this rank's share of the samples the old world had
    not consumed; ``set_epoch`` to another epoch hands over to the wrapped sampler
    (full epochs as before). ``state_dict()`` records the offset, so a later restart
    (same or another world size) resumes this epoch correctly too.

    Padding and ``drop_last`` apply to the rest of the epoch with the new world size:
    without ``drop_last`` the rest is padded to a multiple of the world size by
    repeating its first samples (so up to ``world - 1`` samples are seen twice, as in
    torch's padding); with ``drop_last`` up to ``world - 1`` samples of its tail are
    dropped. With ``even_split=False`` nothing is padded or dropped.
    """

    def __init__(self, sampler, epoch: int, offset: int, start: int = 0):
        self.sampler = sampler
        self._resumed = epoch  # the resumed epoch; None once another epoch began
        self.offset = offset
        s = sampler
        order = epoch_order(_length(s), shuffle=s.shuffle, seed=s.seed, epoch=epoch)
        self._indices = shard_sequence(order[offset:], s.num_replicas, s.rank,
                                       drop_last=s.drop_last, even_split=s.even_split)
        if not 0 <= start <= len(self._indices):
            raise CheckpointMismatchError(
                f"sampler state has consumed={start}, outside [0, {len(self._indices)}] "
                "for the resumed rest of the epoch")
        self._start = start
        self._base = start
        self._iterator = None
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.sampler.epoch:
            self._resumed = None  # the resumed epoch is over: behave as the wrapped sampler
        self.sampler.set_epoch(epoch)

    def indices(self) -> np.ndarray:
        return self._indices if self._resumed is not None else self.sampler.indices()

    def __iter__(self):
        if self._resumed is None:
            return iter(self.sampler)
        start, self._start = self._start, 0
        self._base = start
        self._iterator = iter(self._indices[start:].tolist())
        return self._iterator

    def __len__(self) -> int:
        return len(self._indices) if self._resumed is not None else len(self.sampler)

    def consumed(self) -> int:
        if self._resumed is None:
            return self.sampler.consumed()
        if self._start:
            return self._start
        if self._iterator is None:
            return self._base
        return len(self._indices) - operator.length_hint(self._iterator)

    def state_dict(self) -> dict:
        if self._resumed is None:
            return self.sampler.state_dict()
        out = self.sampler.state_dict()
        out.update(consumed=self.consumed(), offset=self.offset,
                   num_samples=len(self._indices))
        return out

    def load_state_dict(self, state: dict) -> None:
        """This rank's ``state_dict()`` of the same world: the rest of a resumed epoch
        (with an ``offset``) or a plain sampler state."""
        if not state.get("offset", 0):
            self.sampler.load_state_dict(state)
            self._resumed = None
            return
        if state.get("num_replicas", self.sampler.num_replicas) != self.sampler.num_replicas:
            raise CheckpointMismatchError(
                f"sampler state of {state['num_replicas']} replicas loaded into a sampler of "
                f"{self.sampler.num_replicas}; use jdist.checkpoint to resume on another "
                "world size")
        self.__init__(self.sampler, state["epoch"], state["offset"], start=state["consumed"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def __repr__(self) -> str:
        return (f"ResumedSampler({self.sampler!r}, epoch={self.epoch}, "
                f"offset={self.offset}, resumed={self._resumed is not None})")


def resume_sampler(sampler, states: list[dict], rank: int, saved_world: int | None,
                   name: str, elastic: bool = True):
    """``sampler`` (or a :class:`ResumedSampler` around it) at the saved position.

    ``states``: the saved ``state_dict()`` of every rank of the saving world.
    """
    base = sampler.sampler if isinstance(sampler, ResumedSampler) else sampler
    same = saved_world == base.num_replicas and len(states) == base.num_replicas
    if same and not states[rank].get("offset", 0):
        base.load_state_dict(states[rank])
        return base
    if same:
        s = states[rank]
        return ResumedSampler(base, s["epoch"], s["offset"], start=s["consumed"])
    if not elastic:
        raise CheckpointMismatchError(
            f"state[{name!r}]: the sampler was saved by {len(states)} ranks and is restored "
            f"on {base.num_replicas}; pass elastic=True to re-split the epoch")
    for key in ("dataset_length", "shuffle", "drop_last", "even_split", "seed"):
        mine = {"dataset_length": _length(base), "shuffle": base.shuffle,
                "drop_last": base.drop_last, "even_split": base.even_split,
                "seed": base.seed}[key]
        if key in states[0] and states[0][key] != mine:
            raise CheckpointMismatchError(
                f"state[{name!r}]: the saved sampler has {key}={states[0][key]!r}, this one "
                f"{key}={mine!r}; build the sampler with {key}={states[0][key]!r}")
    offset = global_offset(states, name)
    return ResumedSampler(base, states[0]["epoch"], offset)
