"""``DistributedSampler``: torch's sampler, index for index, plus resume and exact eval.

A thin shell over :func:`jdist.sampler.shard_indices`: it holds the configuration, the
epoch and the progress through the current epoch.
"""

from __future__ import annotations

import collections
import itertools
import operator
import warnings
import weakref

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
    """A training sampler ran through the same shuffled epoch twice, in one order.

    Cause: two complete passes over a ``shuffle=True`` sampler with no ``set_epoch`` to a
    new value in between (torch issue #31771): ``set_epoch`` is called with a constant,
    or the program calls it on no sampler at all. A partial pass (a peek such as
    ``next(iter(loader))``, or a loop that breaks early) is not a pass and never warns.
    Who is warned (the rule, see :class:`DistributedSampler`): only shuffled samplers
    whose order feeds training; a ``shuffle=False`` sampler, and a shuffled sampler left
    at one epoch while the program sets the epoch of another one (an evaluation
    sampler), never warn. Fix: call ``sampler.set_epoch(epoch)`` with each epoch's own
    number before that epoch's loop; for an evaluation sampler pass ``shuffle=False``;
    to replay an epoch on purpose, set another epoch in between or filter this warning.
    """


# The samplers of this process whose set_epoch was called (weakly held): a program that
# sets some sampler's epoch knows the per-epoch contract, so a shuffled sampler it leaves
# at one epoch is one whose order it does not need to vary (evaluation).
_EPOCH_SET: weakref.WeakSet = weakref.WeakSet()


def _repeat_matters(sampler) -> bool:
    """Whether a second pass over ``sampler``'s epoch changes training (see the rule in
    :class:`DistributedSampler`)."""
    if not sampler.shuffle:
        return False  # one order every epoch, by design
    return sampler in _EPOCH_SET or not _EPOCH_SET


def _default_replicas_and_rank(num_replicas, rank) -> tuple[int, int]:
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    from jdist.collectives.runtime import group_state  # imports JAX only when needed

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
    * Running through a shuffled training epoch a second time without ``set_epoch``
      changing the epoch warns (:class:`RepeatedEpochWarning`) when the second pass
      ends: both passes were identical. Partial passes (``next(iter(loader))`` to peek at
      a batch) do not count. The rule, since a repeat matters only where the order
      reaches training: (1) ``shuffle=False`` never warns (the same order every epoch is
      its design); (2) a shuffled sampler whose ``set_epoch`` was called warns when an
      epoch repeats (the epoch is managed, and a constant repeats it); (3) a shuffled
      sampler whose ``set_epoch`` was never called warns only if no live sampler of the
      process had ``set_epoch`` called: the program then varies no order at all (the
      torch #31771 mistake). If another sampler's epoch is set, this one is an
      evaluation sampler reused every epoch, whose order changes no metric: silent, as
      in torch. The indices are torch's in every case; only the warning differs.
    * One sampler serves one loader: a pass that is read again after a newer
      ``iter(sampler)`` started (two loaders sharing the sampler, interleaved) raises
      ``RuntimeError`` instead of silently splitting the epoch between them.

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
        self._base = 0  # offset of the current pass in the epoch
        self._iterator = None  # the current pass's list iterator (None: no pass yet)
        self._pass = 0  # number of the newest pass
        self._live = None  # (iterator, box) of the newest pass, cut by the next one
        self._loader = None  # weakref to a ResumableLoader counting what its loop took
        self._completed = False  # a pass ran to the end of this epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with shuffling, each epoch has its own order (seed + epoch).

        A different epoch starts that epoch from its first index, even after
        ``load_state_dict``; the same epoch keeps a loaded position.
        """
        epoch = _as_int(epoch, "epoch")
        _EPOCH_SET.add(self)
        if epoch != self.epoch:
            self._start = 0
            self._base = 0
            self._iterator = None
            self._completed = False
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
        if self._live is not None:  # cut the previous pass: reading it again raises
            old_it, old_box = self._live
            old_box[1] = operator.length_hint(old_it)
            collections.deque(old_it, maxlen=0)  # exhausted: it frees its list, too
        self._start = 0
        self._base = start
        self._pass += 1
        order = order[start:].tolist()
        self._iterator = iter(order)
        box = [self._pass, 0, len(order)]  # pass number, unread when cut, length
        self._live = (self._iterator, box)
        # the list iterator hands out the indices at C speed; the pass's end runs next
        return itertools.chain(self._iterator, self._end_of_pass(box))

    def _end_of_pass(self, box):
        """Runs when a pass's indices ran out: raise if a newer pass cut it short (where
        its next index was due), and check for a repeated epoch. Yields nothing."""
        if box[1]:
            self._shared(box)
        if box[0] != self._pass:
            return  # it ended before a newer pass began; that pass owns the state now
        if self._completed and _repeat_matters(self):
            warnings.warn(
                f"DistributedSampler ran through epoch {self.epoch} a second time, in the "
                "same order as the first pass: set_epoch was not called with a new epoch "
                "between the two passes (a constant, or no call at all). Call "
                "sampler.set_epoch(epoch) with each epoch's own number before the epoch's "
                "loop; to replay an epoch on purpose, set another epoch in between; for "
                "an evaluation sampler, where the order changes nothing, pass "
                "shuffle=False",
                RepeatedEpochWarning,
                stacklevel=2,
            )
        self._completed = True
        return
        yield  # a generator, so that chain() runs the checks above only at the end

    def _shared(self, box) -> None:
        token, unread, length = box
        raise RuntimeError(
            f"{self!r} is read by two consumers: pass {token} ({length - unread} of its "
            f"{length} indices handed out) was read again after a newer iter(sampler) "
            f"began pass {self._pass}. A sampler tracks one pass (state_dict() records "
            "its progress), so two loaders cannot share one: give each DataLoader its own "
            "DistributedSampler (the same arguments give the same order)"
        )

    def _pass_start(self) -> int:
        """Where the next ``__iter__`` begins in the epoch (for ResumableLoader)."""
        return self._start

    def _state_at(self, consumed: int) -> dict:
        """``state_dict()`` with ``consumed`` set: the position a loop really reached."""
        consumed = _as_int(consumed, "consumed")
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(
                f"a loader reports {consumed} samples of epoch {self.epoch} used, outside "
                f"[0, {self.num_samples}] for this rank; its batches do not come from this "
                "sampler (pass the sampler the loader was built with)"
            )
        state = self.state_dict()
        state["consumed"] = consumed
        return state

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
        ahead of training when a data loader prefetches. A
        :class:`~jdist.sampler.ResumableLoader` (or ``ArrayLoader``) reading this
        sampler's current epoch reports what its loop really took instead, so a
        checkpoint of the sampler (``jdist.checkpoint``) resumes at the batch in hand.
        Otherwise, to resume at the exact step, overwrite ``consumed`` with the number
        of samples your loop actually used.
        """
        loader = self._loader() if self._loader is not None else None
        taken = loader._consumed_of(self) if loader is not None else None
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": self.consumed() if taken is None else taken,
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
        self._completed = False
        self._loader = None

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(n={self._n}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, even_split={self.even_split}, "
            f"epoch={self.epoch})"
        )
