"""``DistributedSampler``: torch's sampler, index for index, plus resume and exact eval.

A thin shell over :func:`jdist.sampler.shard_indices`: it holds the configuration, the
epoch and the progress through the current epoch.
"""

from __future__ import annotations

import operator
import warnings

import numpy as np

from jdist.sampler._indices import (
    _as_int,
    _check_split,
    check_replicas_and_rank,
    dataset_length,
    num_samples,
    shard_indices,
)

__all__ = ["DistributedSampler", "RepeatedEpochWarning"]

_NO_GROUP = (
    "Default process group has not been initialized, please make sure to call "
    "init_process_group."
)


class RepeatedEpochWarning(UserWarning):
    """A shuffled sampler was iterated again with the same epoch.

    Cause: ``set_epoch`` was not called (or was called with the same value) between two
    passes, so both passes see the same order (torch issue #31771). Fix: call
    ``sampler.set_epoch(epoch)`` at the start of every epoch.
    """


def _default_replicas_and_rank(num_replicas, rank) -> tuple[int, int]:
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    from jdist.collectives._group import group_state  # imports JAX only when needed

    group = group_state.default_group
    if group is None:
        raise ValueError(_NO_GROUP)
    if num_replicas is None:
        num_replicas = group.size()
    if rank is None:
        rank = group.rank
    return num_replicas, rank


class DistributedSampler:
    """Each process's share of a dataset's indices, exactly as torch's sampler gives them.

    ``list(DistributedSampler(ds, R, r, shuffle, seed, drop_last))`` equals torch's
    ``list(torch.utils.data.DistributedSampler(ds, R, r, shuffle, seed, drop_last))`` for
    every epoch (``set_epoch``), with no torch import: the shuffle reproduces
    ``torch.randperm`` bit for bit (both of torch's algorithms, below and above 214748364).

    Beyond torch:

    * ``state_dict()`` / ``load_state_dict()`` record the epoch, the seed and how many
      indices of the current epoch were already handed out; a sampler loaded mid-epoch
      yields exactly the rest of that epoch (then full epochs again).
    * ``even_split=False`` is for exact evaluation: each index goes to exactly one rank,
      with no padding duplicates, so metrics summed over ranks are exact. Ranks' lengths
      then differ by at most one: run any collective once after the loop (for example
      ``all_reduce`` of metric sums and counts), not once per batch.
    * Iterating a shuffled sampler a second time without ``set_epoch`` changing the
      epoch warns (:class:`RepeatedEpochWarning`): both passes would be identical.

    Args:
      dataset: an int (the dataset length) or anything with ``__len__``.
      num_replicas: number of processes; default: the default process group's size.
      rank: this process's rank; default: its rank in the default process group.
      shuffle: shuffle the indices with ``seed + epoch``.
      seed: base seed, the same on every rank.
      drop_last: cut the tail so all ranks get equally many indices without padding.
      even_split: keyword only; False for exact evaluation (see above).

    Raises:
      ValueError: no process group and ``num_replicas``/``rank`` not given (torch's
        text), an invalid rank (``Invalid rank 4, rank should be in the interval [0,
        3]``), or ``drop_last=True`` with ``even_split=False``.

    Examples:
      >>> [list(DistributedSampler(10, 4, r)) for r in range(4)]
      [[4, 3, 6], [1, 9, 2], [7, 0, 4], [5, 8, 1]]
    """

    def __init__(
        self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
        drop_last=False, *, even_split=True,
    ) -> None:
        num_replicas, rank = _default_replicas_and_rank(num_replicas, rank)
        self.num_replicas, self.rank = check_replicas_and_rank(num_replicas, rank)
        _check_split(drop_last, even_split)
        self.dataset = dataset
        self._n = dataset_length(dataset)
        self.shuffle = bool(shuffle)
        self.seed = _as_int(seed, "seed")
        self.drop_last = bool(drop_last)
        self.even_split = bool(even_split)
        self.epoch = 0
        self.num_samples = num_samples(
            self._n, self.num_replicas, self.rank, drop_last=drop_last,
            even_split=even_split,
        )
        self.total_size = (
            self.num_samples * self.num_replicas if self.even_split else self._n
        )
        self._start = 0  # where the next __iter__ begins (set by load_state_dict)
        self._base = 0  # offset of the current iterator in the epoch
        self._iterator = None  # the live list iterator of this epoch
        self._iterated_epoch = None  # epoch of the last pass from 0 since the epoch changed

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with shuffling, each epoch has its own order (seed + epoch).

        A different epoch starts that epoch from its first index, even after
        ``load_state_dict``; the same epoch keeps a loaded position.
        """
        epoch = _as_int(epoch, "epoch")
        if epoch != self.epoch:
            self._start = 0
            self._base = 0
            self._iterator = None
            self._iterated_epoch = None
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        """All of this rank's indices for the current epoch, as an int64 array.

        Does not count as iteration: no progress is recorded and nothing warns.
        """
        n = dataset_length(self.dataset)
        if n != self._n:
            raise ValueError(
                f"the dataset's length changed from {self._n} to {n} after the sampler "
                "was made; make a new DistributedSampler for the new dataset"
            )
        return shard_indices(
            n, self.num_replicas, self.rank, shuffle=self.shuffle, seed=self.seed,
            epoch=self.epoch, drop_last=self.drop_last, even_split=self.even_split,
        )

    def __iter__(self):
        start = self._start
        order = self.indices()  # raises before any state changes
        if start == 0 and self.shuffle and self._iterated_epoch == self.epoch:
            warnings.warn(
                f"DistributedSampler iterated again with epoch {self.epoch}: this pass "
                "repeats the previous pass's order; call sampler.set_epoch(epoch) at the "
                "start of every epoch",
                RepeatedEpochWarning,
                stacklevel=2,
            )
        if start == 0:
            self._iterated_epoch = self.epoch
        self._start = 0
        self._base = start
        self._iterator = iter(order[start:].tolist())
        return self._iterator

    def __len__(self) -> int:
        """Indices per epoch for this rank (torch's ``num_samples``)."""
        return self.num_samples

    def consumed(self) -> int:
        """How many indices of the current epoch were handed out so far."""
        if self._start:
            return self._start
        if self._iterator is None:
            return self._base
        return self._base + (
            self.num_samples - self._base - operator.length_hint(self._iterator)
        )

    def state_dict(self) -> dict:
        """Epoch, seed and progress, enough to resume mid-epoch.

        ``consumed`` counts indices handed out by the current iterator, which may run
        ahead of training when a data loader prefetches: to resume at the exact step,
        overwrite it with the number of samples your loop actually used.
        """
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": self.consumed(),
            "num_samples": self.num_samples,
            "num_replicas": self.num_replicas,
            "dataset_length": self._n,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "even_split": self.even_split,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; the next ``__iter__`` yields the rest of its epoch.

        Raises:
          KeyError: ``epoch`` or ``consumed`` is missing.
          ValueError: the saved configuration (dataset length, number of replicas,
            shuffle, drop_last, even_split) differs from this sampler's, which would
            give a different order, or ``consumed`` is out of range.
        """
        for key in ("epoch", "consumed"):
            if key not in state:
                raise KeyError(
                    f"sampler state is missing {key!r}; pass a dict from state_dict()"
                )
        checks = {
            "dataset_length": self._n, "num_replicas": self.num_replicas,
            "shuffle": self.shuffle, "drop_last": self.drop_last,
            "even_split": self.even_split,
        }
        for key, mine in checks.items():
            if key in state and state[key] != mine:
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={mine!r}; resuming would give a different order, so build "
                    f"the sampler with {key}={state[key]!r}"
                )
        consumed = _as_int(state["consumed"], "consumed")
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(
                f"sampler state has consumed={consumed}, outside [0, {self.num_samples}] "
                "for this rank"
            )
        if "seed" in state:
            self.seed = _as_int(state["seed"], "seed")
        self.epoch = _as_int(state["epoch"], "epoch")
        self._start = consumed
        self._base = consumed
        self._iterator = None
        self._iterated_epoch = self.epoch if consumed else None

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(n={self._n}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, even_split={self.even_split}, "
            f"epoch={self.epoch})"
        )
