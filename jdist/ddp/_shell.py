"""What both DDP wrappers share: set-up of the engine and the torch-named controls.

:class:`~jdist.ddp.DistributedDataParallel` (NNX) and :class:`~jdist.ddp.FunctionalDDP`
(pytrees) differ only in how they hold parameters and build pure functions; the group,
init sync, engine, comm hook, ``no_sync`` and ``join`` are one piece of code here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jdist.collectives.runtime import ProcessGroup, resolve_group
from jdist.ddp import _sync
from jdist.ddp._buckets import BucketCapacityConfig, BucketLayout
from jdist.ddp._engine import Engine
from jdist.ddp._join import Join, JoinableDDP
from jdist.errors import NoParametersError

__all__ = ["EngineShell", "NO_PARAMS_MSG"]

NO_PARAMS_MSG = ("DistributedDataParallel is not needed when a module doesn't have any "
                 "parameter that requires a gradient.")


class EngineShell(JoinableDDP):
    """Base of the DDP wrappers: holds ``process_group`` and the step ``_engine``; a
    :class:`~jdist.algorithms.join.Joinable` (see :mod:`jdist.ddp._join`)."""

    process_group: ProcessGroup
    _engine: Engine

    def _start(self, infos: list, params: Any, buffers: Any, *,
               process_group: ProcessGroup | None, bucket_cap_mb: float | None,
               find_unused_parameters: bool, broadcast_buffers: bool, init_sync: bool,
               comm_hook: Any, compiler_options: dict | None, flat_buckets: bool | None,
               forward_sync_buffers: bool | None,
               bucket_cap_mb_list: Any = None) -> tuple[Any, Any, bool]:
        """Resolve the group, sync from rank 0, build the engine, register ``comm_hook``.

        Returns ``(params, buffers, synced)``: rank 0's values when ``synced`` (buffers
        too unless ``broadcast_buffers=False`` was the only buffer argument: torch 2.13's
        ``forward_sync_buffers=False`` still syncs buffers at init), else the arguments
        unchanged.
        """
        init_buffers = broadcast_buffers
        if forward_sync_buffers is not None:  # torch 2.13's name for broadcast_buffers
            broadcast_buffers, init_buffers = bool(forward_sync_buffers), True
        self.process_group = resolve_group(process_group)
        if not infos:
            raise NoParametersError(NO_PARAMS_MSG)
        self.bucket_config = BucketCapacityConfig.create(bucket_cap_mb, bucket_cap_mb_list)
        synced = init_sync and self.process_group.size() > 1
        if synced:
            params, synced_buffers = _sync.init_sync(self.process_group, infos, params,
                                                     buffers if init_buffers else None)
            if init_buffers:
                buffers = synced_buffers
        self._engine = Engine(self.process_group, infos, bucket_cap_mb=self.bucket_config,
                              find_unused_parameters=find_unused_parameters,
                              broadcast_buffers=broadcast_buffers,
                              compiler_options=compiler_options,
                              flat_buckets=flat_buckets)
        if synced:
            self._engine.donation.made(params)
        if comm_hook is not None:
            state, hook = comm_hook if isinstance(comm_hook, tuple) else (None, comm_hook)
            self.register_comm_hook(state, hook)
        return params, buffers, synced

    @property
    def buckets(self) -> BucketLayout:
        """The bucket layout: paths and bytes per bucket (rebuilt in gradient-ready order
        at the first step)."""
        return self._engine.layout

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        """The per-bucket caps from ``bucket_cap_mb_list`` in bytes (``[]`` without)."""
        return list(self.bucket_config.per_bucket_bytes_caps)

    @property
    def forward_sync_buffers(self) -> bool:
        """Whether each forward takes replica 0's buffers (torch 2.13's name)."""
        return self._engine.broadcast_buffers

    @property
    def broadcast_buffers(self) -> bool:
        """The same as :attr:`forward_sync_buffers` (torch's older name)."""
        return self._engine.broadcast_buffers

    @property
    def require_backward_grad_sync(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self._engine.require_backward_grad_sync

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Reduce buckets with ``hook(state, bucket) -> (buffer, new_state)``.

        Call once, before the first step (torch's rule). ``state`` is a pytree of arrays
        (or ``None``); DDP keeps one copy per replica and threads it through every step
        and, within a step, from bucket to bucket in reduction order. The hook runs
        inside the step's ``shard_map``: it must return a buffer shaped like
        ``bucket.buffer`` that is the same on every replica (reduce over
        ``bucket.axis_name``). See :mod:`jdist.ddp.hooks`.
        """
        self._engine.hooks.register(state, hook, self._engine.steps)

    @property
    def replica_hook_state(self) -> Any:
        """The comm hook's array state as DDP keeps it (every leaf stacked per replica,
        sharded over the replica axis), or ``None`` before the first step / without a
        hook. Read by :mod:`jdist.checkpoint`."""
        h = self._engine.hooks
        return h.state if h.hook is not None and h.ready else None

    def load_replica_hook_state(self, loader: Callable[[Any], Any]) -> None:
        """Set the hook state to ``loader(replica_hook_state)`` (deferred to the first
        step when the state is not prepared yet); see ``HookSlot.load``."""
        self._engine.hooks.load(loader)

    @property
    def comm_hook_state(self) -> Any:
        """The hook state of this process's first replica (after the last step)."""
        return self._engine.hooks.user_state()

    def shard_batch(self, batch: Any) -> Any:
        """This process's ``batch`` as the group's global batch, split over its replicas.

        The data-parallel path for an existing Flax loop: keep the ``@nnx.jit``
        ``train_step(model, optimizer, metrics, batch)`` and call it with
        ``ddp.shard_batch(batch)``. The parameters (the same on every process, as DDP
        keeps them) and a batch split over the group's devices make XLA compute the
        gradient of the loss over the global batch, all-reduce included, exactly as one
        device would over the concatenated batches of every process; metrics updated in
        the step are the
        global ones, and the step's ``nnx.Rngs`` advance as usual. Unlike DDP's own steps
        (torch's semantics: each replica's forward sees its own shard), layers that mix
        examples (batch statistics) see the global batch, as ``SyncBatchNorm``. Without
        it, each process would train on its own batch with no reduction and the
        replicas would drift apart (the next DDP call raises
        :class:`~jdist.errors.ReplicaDivergenceError`).

        Every leaf needs this process's batch size (a multiple of its device count) as
        its leading dimension, the same on every process.
        """
        from jdist.ddp._placement import shard_batch

        return shard_batch(batch, self.process_group)

    def no_sync(self):
        """Context manager: steps inside accumulate local gradients, no collective.

        The first synced step after it reduces (accumulated + new) gradients once, and
        does not broadcast buffers (torch's rule). ``train_step`` skips the optimizer
        update inside it.
        """
        return self._engine.no_sync()

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs across processes: ``Join([self], ...)``
        (torch's ``DistributedDataParallel.join``; see :mod:`jdist.ddp._join`)."""
        return Join([self], enable=enable,
                    throw_on_early_termination=throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)
