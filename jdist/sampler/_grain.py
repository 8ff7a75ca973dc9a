"""grain with torch's order: a grain ``Sampler`` and ``MapDataset`` over jdist's indices.

grain (``pip install jdist[grain]``) shards records first and shuffles within the shard,
so its order is not torch's. Here the order is jdist's (torch's, index for index): record
``p`` of this rank's stream is position ``p`` of the concatenated per-epoch orders of
:func:`jdist.sampler.shard_indices`, computed by random access (the epoch's order is
made once and cached). grain's own sharding stays off (``NoSharding``): the indices are
already this rank's, so sharding again would drop records.

With workers, grain's ``DataLoader`` gives worker ``w`` the records ``w, w + W, ...`` and
batches inside each worker, so a batch would hold every W-th record. Told the worker
count and batch size (:func:`grain_loader` reads them from its arguments), the sampler
hands each worker the records that make its batches torch's batches, in torch's order.

grain is imported only when one of these objects is made.
"""

from __future__ import annotations

import sys

import numpy as np

from jdist.sampler._indices import shard_indices

__all__ = ["GrainSampler", "grain_dataset", "grain_loader"]


def _grain():
    try:
        import grain
    except ImportError:
        raise ImportError(
            "the grain adapter needs grain: pip install 'jdist[grain]' (or pip install "
            "grain)"
        ) from None
    return grain


class GrainSampler:
    """A grain ``Sampler``: this rank's records in jdist's (torch's) order, over epochs.

    The stream starts where ``sampler`` stands (its epoch, and the position a
    ``load_state_dict`` left it at) and runs ``epochs`` epochs from there (``None``:
    endless, like grain's ``IndexSampler(num_epochs=None)``). Record ``p`` is
    position ``start + p`` of the epochs' orders, each epoch as
    ``sampler.set_epoch(e); list(sampler)`` gives it.

    Args:
      sampler: a :class:`~jdist.sampler.DistributedSampler` (only its configuration and
        position are read; it is not iterated).
      epochs: epochs the stream covers, counted from ``sampler.epoch``; None: endless.
      worker_count, batch_size: the grain ``DataLoader``'s ``worker_count`` and its
        ``Batch`` size, so that batches made inside grain's workers come out as
        torch's batches (see the module notes); leave them 0 / None otherwise.
      rng: give each record a ``numpy.random.Generator`` for grain's ``RandomMap``
        (about half of this sampler's cost per record); False: ``rng=None``.

    ``state_dict(records)`` gives the :class:`~jdist.sampler.DistributedSampler` state
    after ``records`` records of the stream; load it into a sampler and make a new
    GrainSampler from it to resume.
    """

    def __init__(self, sampler, *, epochs: int | None = 1, worker_count: int = 0,
                 batch_size: int | None = None, rng: bool = True) -> None:
        grain = _grain()
        for attr in ("num_samples", "num_replicas", "rank", "seed", "epoch"):
            if not hasattr(sampler, attr):
                raise TypeError(
                    f"GrainSampler needs a jdist DistributedSampler, got "
                    f"{type(sampler).__name__}"
                )
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                                   or epochs < 1):
            raise ValueError(f"epochs must be a positive int or None (endless), got {epochs!r}")
        if not isinstance(worker_count, int) or worker_count < 0:
            raise ValueError(f"worker_count must be an int >= 0, got {worker_count!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
        self._state = sampler.state_dict()
        self._config = dict(
            n=self._state["dataset_length"], num_replicas=sampler.num_replicas,
            rank=sampler.rank, shuffle=sampler.shuffle, seed=sampler.seed,
            drop_last=sampler.drop_last, even_split=sampler.even_split,
        )
        self.num_samples = sampler.num_samples
        self.start_epoch = sampler.epoch
        self.start = sampler._pass_start()
        self.epochs = epochs
        self.worker_count, self.batch_size = worker_count, batch_size
        self.rng = bool(rng)
        if self.num_samples == 0:
            self._length = 0
        elif epochs is None:
            self._length = sys.maxsize
        else:
            self._length = epochs * self.num_samples - self.start
        self._cache: dict[int, np.ndarray] = {}
        self._shard_options = grain.sharding.NoSharding()  # read by grain.DataLoader
        self._metadata = grain.RecordMetadata

    def __len__(self) -> int:
        return self._length

    def order(self, epoch: int) -> np.ndarray:
        """This rank's indices of ``epoch`` (cached; the last two epochs are kept)."""
        got = self._cache.get(epoch)
        if got is None:
            cfg = self._config
            got = shard_indices(cfg["n"], cfg["num_replicas"], cfg["rank"],
                                shuffle=cfg["shuffle"], seed=cfg["seed"], epoch=epoch,
                                drop_last=cfg["drop_last"], even_split=cfg["even_split"])
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = got
        return got

    def position(self, index: int) -> int:
        """The stream position grain's record ``index`` holds (undoes worker striding)."""
        w, b = self.worker_count, self.batch_size
        if w <= 1 or b is None:
            return index
        length = self._length
        worker, j = index % w, index // w
        k, t = divmod(j, b)
        done = k * b  # records each worker put in its first k batches, at most
        pos = t
        for v in range(w):
            count = (length - v + w - 1) // w  # records grain gives worker v
            pos += min(count, done)
            if v < worker:
                pos += min(max(count - done, 0), b)
        return pos

    def _locate(self, index: int) -> tuple[int, int]:
        """``(absolute stream position, dataset index)`` of grain's record ``index``."""
        if not 0 <= index < self._length:
            raise IndexError(
                f"record {index} is outside this rank's stream of {self._length} records"
            )
        p = self.start + self.position(index)
        epoch, pos = divmod(p, self.num_samples)
        key = int(self.order(self.start_epoch + epoch)[pos])
        return self.start_epoch * self.num_samples + p, key

    def key(self, index: int) -> int:
        """The dataset index of grain's record ``index``."""
        return self._locate(index)[1]

    def __getitem__(self, index: int):
        absolute, key = self._locate(index)
        rng = None
        if self.rng:
            # per-record randomness for grain's RandomMap: a function of the record's
            # place in the whole run (so a resumed run draws the same), distinct per rank
            word = (absolute * self._config["num_replicas"] + self._config["rank"]) % 2**64
            rng = np.random.Generator(
                np.random.Philox(key=[self._config["seed"] % 2**64, word]))
        return self._metadata(index=index, record_key=key, rng=rng)

    def _pass_start(self) -> int:
        return 0

    def _state_at(self, records: int) -> dict:
        return self.state_dict(records)

    def state_dict(self, records: int = 0) -> dict:
        """The DistributedSampler state after ``records`` records of this stream."""
        if not 0 <= records <= self._length:
            raise ValueError(
                f"records={records} is outside this rank's stream of {self._length} "
                "records; count the records the loop took from this GrainSampler's loader"
            )
        state = dict(self._state)
        if self.num_samples:
            epoch, consumed = divmod(self.start + records, self.num_samples)
            state["epoch"], state["consumed"] = self.start_epoch + epoch, consumed
        return state

    def load_state_dict(self, state: dict) -> None:
        raise TypeError(
            "a GrainSampler is fixed once grain has read its length: load the state into "
            "the DistributedSampler (sampler.load_state_dict(state)) and make a new "
            "GrainSampler and grain loader from it"
        )

    def __repr__(self) -> str:
        c = self._config
        return (f"GrainSampler(n={c['n']}, num_replicas={c['num_replicas']}, "
                f"rank={c['rank']}, shuffle={c['shuffle']}, seed={c['seed']}, "
                f"drop_last={c['drop_last']}, start_epoch={self.start_epoch}, "
                f"start={self.start}, epochs={self.epochs}, "
                f"worker_count={self.worker_count}, batch_size={self.batch_size})")


class _Records:
    """A random-access source: record ``p`` is ``source[sampler.key(p)]``."""

    def __init__(self, source, sampler: GrainSampler) -> None:
        self.source, self.sampler = source, sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __getitem__(self, index: int):
        return self.source[self.sampler.key(int(index))]


def grain_dataset(source, sampler, *, epochs: int | None = 1):
    """A grain ``MapDataset`` of ``source``'s records in this rank's jdist order.

    Element ``p`` is ``source[i]`` for the ``p``-th index of the stream (see
    :class:`GrainSampler`). Chain grain's transformations as usual; ``.batch(B)`` before
    ``.to_iter_dataset()`` keeps torch's batches with any number of ``mp_prefetch``
    workers (grain splits a MapDataset between workers by element).
    """
    grain = _grain()
    _check_length(source, sampler)
    return grain.MapDataset.source(_Records(source, GrainSampler(sampler, epochs=epochs)))


def _check_length(source, sampler) -> None:
    n = sampler.state_dict()["dataset_length"]
    if len(source) != n:
        raise ValueError(
            f"the sampler is over {n} records but the source has {len(source)}; build the "
            f"DistributedSampler over len(source) ({len(source)})"
        )


def grain_loader(data_source, sampler, *, operations=(), worker_count: int = 0,
                 epochs: int | None = 1, shard_options=None, **kwargs):
    """A ``grain.DataLoader`` that reads ``data_source`` in this rank's jdist order.

    Like ``grain.DataLoader(data_source=..., sampler=..., operations=...,
    worker_count=...)`` with a :class:`GrainSampler` made from ``sampler`` (worker count
    and ``Batch`` size taken from the arguments, so batches are torch's) and grain's
    sharding off; records get a random generator only if an operation is a
    ``RandomMap``. Extra keyword arguments go to ``grain.DataLoader``. The loader's
    ``sampler`` attribute is that GrainSampler (``ResumableLoader(loader)`` uses it).

    Raises:
      ValueError: ``shard_options`` asks grain to shard (the indices already are this
        rank's; sharding again would drop records); ``data_source`` and the sampler
        disagree on the number of records.
    """
    grain = _grain()
    none = grain.sharding.NoSharding()
    if shard_options is not None and shard_options != none:
        raise ValueError(
            f"shard_options={shard_options!r}: the jdist sampler already gives this rank "
            "its share, so grain must not shard again; leave shard_options out"
        )
    _check_length(data_source, sampler)
    batch = [op for op in operations if isinstance(op, grain.transforms.Batch)]
    size = batch[0].batch_size if len(batch) == 1 else None
    if worker_count and len(batch) > 1:
        raise ValueError(
            f"{len(batch)} Batch operations with worker_count={worker_count}: batches made "
            "in grain's workers follow torch's order only with one Batch; use one"
        )
    if worker_count:
        from absl import flags  # grain's workers read absl flags (defaults if unparsed)

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
    random = any(isinstance(op, grain.transforms.RandomMap) for op in operations)
    ordered = GrainSampler(sampler, epochs=epochs, worker_count=worker_count, batch_size=size,
                           rng=random)
    loader = grain.DataLoader(data_source=data_source, sampler=ordered,
                              operations=list(operations), worker_count=worker_count,
                              shard_options=none, **kwargs)
    loader.sampler = ordered  # so that ResumableLoader(loader) finds it
    return loader
