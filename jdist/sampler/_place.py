"""Where batches go (the layout DDP wants) and a background thread that fills them ahead.

DDP takes a process-local batch and splits its leading dimension over the process's
devices: the global array is laid out ``NamedSharding(group.mesh, P(group.axis_name))``.
A batch already placed that way is used as is (no second transfer), so a loader that
places batches with :func:`batch_sharding` of the DDP object hands DDP finished arrays.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

__all__ = ["batch_sharding", "local_devices", "check_divides", "place", "Prefetcher"]

_END = object()


def batch_sharding(target):
    """The sharding of a process-local batch for ``target``, or None (host numpy).

    ``target`` is None, a ``DistributedDataParallel`` (anything with a
    ``process_group``), a ``ProcessGroup`` (``mesh`` and ``axis_name``), a
    ``jax.sharding.Sharding`` or a single ``jax.Device``.
    """
    if target is None:
        return None
    import jax
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    if isinstance(target, jax.sharding.Sharding):
        return target
    if isinstance(target, jax.Device):
        return SingleDeviceSharding(target)
    group = getattr(target, "process_group", target)
    mesh, axis = getattr(group, "mesh", None), getattr(group, "axis_name", None)
    if mesh is None or axis is None:
        raise TypeError(
            f"place= must be None, a DistributedDataParallel, a ProcessGroup, a "
            f"jax.sharding.Sharding or a jax.Device; got {type(target).__name__}"
        )
    return NamedSharding(mesh, P(axis))


def local_devices(sharding) -> int:
    """How many of this process's devices a batch is split over (1: not split)."""
    if sharding is None or sharding.is_fully_replicated:
        return 1
    return len(sharding.addressable_devices)


def check_divides(rows: int, devices: int, what: str) -> None:
    """Raise if a batch of ``rows`` samples does not split evenly over ``devices``."""
    if devices > 1 and rows % devices:
        raise ValueError(
            f"{what} has {rows} samples, which does not split evenly over this process's "
            f"{devices} devices ({rows} % {devices} = {rows % devices}); use a per-process "
            f"batch size that is a multiple of {devices} (e.g. "
            f"{max(devices, rows - rows % devices)}) and drop the last partial batch "
            "(drop_last=True)"
        )


def place(batch, sharding):
    """``batch`` (a pytree of host arrays) as global arrays laid out by ``sharding``."""
    import jax

    if sharding is None:
        return batch
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    if sharding.is_fully_addressable:
        leaves = jax.device_put(leaves, sharding)
    else:  # several processes: each gives its own rows of the global batch
        leaves = [jax.make_array_from_process_local_data(sharding, np.asarray(x))
                  for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)


class Prefetcher:
    """Runs ``make(item)`` for the items of ``source`` in a thread, ``depth`` ahead.

    Iterating yields ``make``'s results in order. An exception in the thread is raised
    in the consumer, in place of the item that failed. ``close()`` (also on garbage
    collection of the generator that uses it) stops the thread. Waiting for an item
    gives up after ``timeout`` seconds, naming ``what`` it waited for.
    """

    def __init__(self, source, make, depth: int, timeout: float, what: str) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._timeout = timeout
        self._what = what
        self._thread = threading.Thread(target=self._run, args=(source, make),
                                        name="jdist-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, source, make) -> None:
        try:
            for item in source:
                if not self._put((True, make(item))):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put((False, e))
            return
        self._put((True, _END))

    def __iter__(self):
        return self

    def __next__(self):
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                ok, value = self._q.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    raise RuntimeError(
                        f"the prefetch thread for {self._what} ended without a result"
                    ) from None
                if time.monotonic() >= deadline:
                    self.close()
                    raise TimeoutError(
                        f"waited {self._timeout:g} s for the next batch from {self._what}; "
                        "the loader is stuck or slower than that per batch (pass a larger "
                        "timeout= if that is expected)"
                    ) from None
        if not ok:
            self.close()
            raise value
        if value is _END:
            self.close()
            raise StopIteration
        return value

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
