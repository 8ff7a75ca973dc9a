"""``ResumableLoader``: any loader over a jdist sampler, resumable at the batch in hand.

A data loader reads ahead (torch's workers prefetch ``num_workers * prefetch_factor``
batches, grain's workers their buffers, and this wrapper one or more batches onto the
devices), so the sampler's own progress runs ahead of training. The wrapper counts the
samples of the batches it has *handed to the loop* and reports the sampler's state at
that point: resuming from it yields exactly the batches an uninterrupted run would have
yielded next, and the loader reads only those samples (the sampler starts where the
state says; nothing is read and thrown away to fast-forward).
"""

from __future__ import annotations

import weakref

from jdist.sampler._collate import batch_rows
from jdist.sampler._place import Prefetcher, batch_sharding, check_divides, local_devices
from jdist.sampler._place import place as place_batch

__all__ = ["ResumableLoader"]

class ResumableLoader:
    """Wraps a loader whose order comes from ``sampler``; adds exact mid-epoch resume.

    Works with a ``torch.utils.data.DataLoader`` built with ``sampler=`` a
    :class:`~jdist.sampler.DistributedSampler` (any ``num_workers``,
    ``persistent_workers``), a grain loader over a :class:`~jdist.sampler.GrainSampler`,
    or any re-iterable of batches in the sampler's order. Optionally puts each batch on
    the devices the way DDP wants it, a batch or more ahead, from a background thread.

    Args:
      loader: the loader; each ``iter(loader)`` is one pass (one epoch for torch's
        DataLoader, the whole stream for grain's).
      sampler: the sampler that orders it; default ``loader.sampler``.
      place: None (batches as the loader gives them), a ``DistributedDataParallel`` or
        ``ProcessGroup`` (split each batch over this process's devices, DDP's layout),
        a ``jax.sharding.Sharding`` or a ``jax.Device``.
      prefetch: batches prepared ahead in a background thread (0: none, each batch is
        read and placed when the loop asks for it).
      timeout: seconds to wait for one batch before raising ``TimeoutError``.

    ``state_dict()`` is the sampler's state (the same keys, plain ints and bools) with
    ``consumed`` at the samples handed to the loop; ``load_state_dict`` loads it into
    the sampler, and the next pass yields the rest of that epoch.

    Two loaders over one ``DistributedSampler`` fail when they are read together: the
    sampler raises ``RuntimeError`` as soon as an older pass is read after a newer one
    began (give each loader its own sampler). Making a new loader over the same sampler,
    for example once per epoch, is fine.

    Raises:
      ValueError: ``place`` splits batches over devices and the loader's batch size (or
        an epoch's last batch, without ``drop_last``) does not divide over them.
      TypeError: no jdist sampler found (pass ``sampler=``).
    """

    def __init__(self, loader, sampler=None, *, place=None, prefetch: int = 1,
                 timeout: float = 300.0) -> None:
        sampler = sampler if sampler is not None else getattr(loader, "sampler", None)
        if not (hasattr(sampler, "_state_at") and hasattr(sampler, "_pass_start")):
            raise TypeError(
                f"ResumableLoader needs the jdist sampler that orders the loader "
                f"(DistributedSampler or GrainSampler), got {type(sampler).__name__}; "
                "build the loader with sampler=jdist.sampler.DistributedSampler(...) or "
                "pass sampler= explicitly"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (batches ahead), got {prefetch!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.loader = loader
        self.sampler = sampler
        self.prefetch = prefetch
        self.timeout = float(timeout)
        self.sharding = batch_sharding(place)
        self._devices = local_devices(self.sharding)
        # torch's DataLoader(batch_size=None) yields one sample per index, unbatched
        self._per_sample = (hasattr(loader, "batch_sampler") and loader.batch_sampler is None
                            and getattr(loader, "batch_size", 0) is None)
        self._check_batch_size()
        self._begin = None  # position of the current pass's start (None: no pass yet)
        self._taken = 0  # samples handed to the loop in the current pass
        self._pass = 0
        self._epoch = None

    def _check_batch_size(self) -> None:
        size = getattr(self.loader, "batch_size", None)
        if self._devices <= 1 or not isinstance(size, int):
            return
        check_divides(size, self._devices, f"the loader's batch (batch_size={size})")
        rows = len(self.sampler) if hasattr(self.sampler, "__len__") else None
        if not getattr(self.loader, "drop_last", True) and rows is not None:
            check_divides(rows % size or size, self._devices,
                          f"the last batch of an epoch ({rows} samples per epoch, "
                          f"batch_size={size}; DataLoader(drop_last=False))")

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch(epoch)`` (convenience)."""
        self.sampler.set_epoch(epoch)

    def _host(self, batch):
        rows = 1 if self._per_sample else batch_rows(batch)
        if self._devices > 1:
            check_divides(rows, self._devices, "a batch")
        return rows, place_batch(batch, self.sharding)

    def __iter__(self):
        begin = self.sampler._pass_start()  # before iter(loader): that starts a pass
        if hasattr(self.sampler, "_loader"):  # the sampler's state_dict() asks this loader
            self.sampler._loader = weakref.ref(self)
        self._pass += 1
        token = self._pass
        self._begin, self._taken = begin, 0
        self._epoch = getattr(self.sampler, "epoch", None)
        source = iter(self.loader)
        what = f"{type(self.loader).__name__} (pass {token})"
        items = (Prefetcher(source, self._host, self.prefetch, self.timeout, what)
                 if self.prefetch else map(self._host, source))
        try:
            for rows, batch in items:
                if self._pass == token:
                    self._taken += rows
                yield batch
        finally:
            if self.prefetch:
                items.close()

    def _consumed_of(self, sampler):
        """Samples of ``sampler``'s current epoch handed to the loop (None: not known)."""
        if sampler is not self.sampler or self._begin is None:
            return None
        if getattr(sampler, "epoch", None) != self._epoch:
            return None
        return self._begin + self._taken

    def state_dict(self) -> dict:
        """The sampler's ``state_dict()`` at the samples handed to the loop so far.

        While this loader reads the sampler's epoch, ``sampler.state_dict()`` gives the
        same (so checkpointing the sampler itself is exact too)."""
        if self._begin is None or getattr(self.sampler, "epoch", None) != self._epoch:
            return self.sampler.state_dict()  # no pass yet in this epoch
        return self.sampler._state_at(self._begin + self._taken)

    def load_state_dict(self, state: dict) -> None:
        """Load ``state`` into the sampler; the next pass yields the rest of its epoch."""
        self.sampler.load_state_dict(state)
        self._begin, self._taken = None, 0

    def __repr__(self) -> str:
        return f"ResumableLoader({type(self.loader).__name__}, sampler={self.sampler!r})"
