"""Each rank's part as one Orbax checkpoint: a PyTree of host arrays and a JSON record.

Every rank is its own Orbax "primary host" with only itself as an active process, so
Orbax never waits on other ranks (the ranks agree through the directory layout,
:mod:`jdist.checkpoint._layout`). Orbax writes a part under a temporary name and
renames it once complete (its atomic finalize).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["Writer", "read_part"]


_REGISTRY: list = []


def _registry():
    """A type registry whose numpy handler writes on every rank.

    Orbax's own ``NumpyHandler`` treats host arrays as replicated and writes them on
    process 0 only; here each rank's arrays are its own part.
    """
    if _REGISTRY:
        return _REGISTRY[0]
    import asyncio

    import jax
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    from orbax.checkpoint._src.serialization.type_handler_registry import (
        create_type_handler_registry,
    )
    from orbax.checkpoint._src.serialization.type_handlers import ArrayHandler, NumpyHandler

    class RankNumpyHandler(NumpyHandler):
        async def _background_serialize(self, values, infos, args=None):
            args = args if args is not None else [None] * len(values)
            writes = []
            for value, info, arg in zip(values, infos, args, strict=True):
                await info.await_path_creation()
                spec = ts_utils.build_array_write_spec(
                    info=info, arg=arg, global_shape=value.shape, local_shape=value.shape,
                    dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
                    process_index=ocdbt_utils.get_process_index_for_subdir(
                        use_ocdbt=info.is_ocdbt_checkpoint,
                        override_ocdbt_process_id=self._override_ocdbt_process_id),
                    metadata_key=self._metadata_key)
                writes.append(self._open_and_write(value, spec.json, info.ts_context))
            await asyncio.gather(*writes)

    # the manager already copied the arrays out of the training state; jax.Array is
    # registered only so that Orbax does not warn at every save (none are saved), and
    # without a metadata store, so that no save validates (reads back) jax.Array
    # metadata that no part has
    _REGISTRY.append(create_type_handler_registry(
        (np.ndarray, RankNumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ArrayHandler(array_metadata_store=None))))
    return _REGISTRY[0]


class _NoMergeWarning(logging.Filter):
    """Drops Orbax's warning that a save had no OCDBT database to merge: jdist writes
    plain zarr files (see ``_handler``), and Orbax's finalize looks for one at every
    save."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in str(record.msg)


def _handler(rank: int):
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.handlers.composite_checkpoint_handler import CompositeOptions

    mp = ocp.options.MultiprocessingOptions(primary_host=rank, active_processes={rank})
    # plain zarr files, not an OCDBT database: a part holds one array per dtype, and
    # OCDBT's manifest and data-file bookkeeping cost more CPU per save than the few
    # files it saves (reads detect either layout, so older parts still restore).
    # Directories made synchronously: Orbax's asynchronous creation signals completion
    # through the job-wide key-value store under keys that are the same on every
    # process, so two ranks saving at once would read each other's signals
    sync_dirs = ocp.options.AsyncOptions(create_directories_asynchronously=False)
    if not any(isinstance(f, _NoMergeWarning) for f in logging.getLogger("absl").filters):
        logging.getLogger("absl").addFilter(_NoMergeWarning())
    handler = ocp.CompositeCheckpointHandler(
        arrays=ocp.PyTreeCheckpointHandler(multiprocessing_options=mp, use_compression=False,
                                           use_ocdbt=False, type_handler_registry=_registry()),
        meta=ocp.JsonCheckpointHandler(multiprocessing_options=mp),
        composite_options=CompositeOptions(multiprocessing_options=mp,
                                           async_options=sync_dirs))
    return handler, mp


def _process_index() -> int:
    import jax

    return jax.process_index()


def _background_priority() -> None:
    """Lowers the calling thread's CPU priority (Linux: nice is per thread) so that a
    write in the background takes the cores when the training step leaves them idle
    instead of slowing the step; it still gets a share under full load."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:  # not permitted here: the write runs at normal priority
            pass


class Writer:
    """Saves this rank's parts, in a background thread or not, at most one in flight.

    The write itself is Orbax's synchronous ``Checkpointer.save`` (temporary directory,
    then rename), run in a thread of ours when ``async_save``: Orbax's own
    ``AsyncCheckpointer`` coordinates through process-wide signals that assume one
    primary process, while here every rank writes a part of its own.
    """

    def __init__(self, async_save: bool):
        import orbax.checkpoint as ocp

        handler, mp = _handler(_process_index())
        self.async_save = bool(async_save)
        self._ck = ocp.Checkpointer(handler, multiprocessing_options=mp)
        self.in_flight: str | None = None
        self._thread: threading.Thread | None = None
        self._error: list = []
        self._last: dict | None = None  # the arrays of the last write

    def save(self, path: str, make_arrays, meta: dict, prepare=None, then=None) -> None:
        """Write ``make_arrays(spare)`` and ``meta``, in the writer's thread when
        asynchronous.

        ``make_arrays`` gets the arrays of the last write (``spare``: its buffers may be
        filled again, that write has ended) and returns the arrays to write;
        ``prepare(arrays, meta)`` runs next and ``then()`` once the part is complete.
        All of it runs in that thread, so none of it costs the training loop.
        """
        import orbax.checkpoint as ocp

        def write_now():
            spare, self._last = self._last, None
            arrays = self._last = make_arrays(spare)
            if prepare is not None:
                prepare(arrays, meta)
            items = {"meta": ocp.args.JsonSave(meta)}
            if arrays:
                items["arrays"] = ocp.args.PyTreeSave(arrays)
            self._ck.save(path, args=ocp.args.Composite(**items))
            if then is not None:
                then()

        if not self.async_save:
            write_now()
            return

        def write():
            _background_priority()
            try:
                write_now()
            except BaseException as e:  # surfaced by wait() in the training thread
                self._error.append(e)

        self.in_flight = path
        self._thread = threading.Thread(target=write, name="jdist-checkpoint-write",
                                        daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> None:
        """Wait until the save in flight is on disk (raises TimeoutError naming it)."""
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(
                f"the checkpoint write of {self.in_flight} did not finish within "
                f"{timeout:g} s (a slow or hung file system?); pass a larger timeout to "
                "CheckpointManager")
        self._thread, self.in_flight = None, None
        if self._error:
            raise self._error.pop()

    def close(self) -> None:
        self._ck.close()


def read_part(path: str, with_arrays: bool, names: list[str] | None = None) -> tuple:
    """``(arrays, meta)`` of one finished part (``arrays`` is ``{}`` if not asked)."""
    import orbax.checkpoint as ocp

    handler, mp = _handler(_process_index())
    ck = ocp.Checkpointer(handler, multiprocessing_options=mp)
    items: dict[str, Any] = {"meta": ocp.args.JsonRestore()}
    if with_arrays and names:
        restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in names}
        items["arrays"] = ocp.args.PyTreeRestore(restore_args=restore_args)
    try:
        out = ck.restore(path, args=ocp.args.Composite(**items))
    finally:
        ck.close()
    arrays = dict(out["arrays"]) if "arrays" in items else {}
    return arrays, out["meta"]
