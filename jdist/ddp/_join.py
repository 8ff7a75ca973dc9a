"""DDP as a :class:`~jdist.algorithms.join.Joinable`: uneven inputs across processes.

``with Join([ddp]):`` (or ``with ddp.join():``, the same thing) runs torch's generic
join algorithm (:mod:`jdist.algorithms._join`) with DDP's hook:

- Each DDP step of a process that still has inputs first calls
  ``Join.notify_join_context(ddp)`` (one all-reduce of a 1 when DDP is the context's
  first joinable), then all-reduces its sync flags (MAX of ``[sync, sync_buffers]``:
  whether this step reduces gradients, i.e. is not under ``no_sync()``, and whether it
  broadcasts buffers first; torch all-reduces the same flag), then runs its compiled
  step in join mode, which also counts the replicas that still have inputs.
- :meth:`DDPJoinHook.main_hook` (a process out of inputs, once per iteration of the
  others) answers the flags all-reduce with zeros and *replays* its last step with
  those flags and its replicas marked inactive: the same compiled SPMD program, so
  every collective of the processes still training has a partner (the flags also carry
  their batch size: a smaller last batch there is met by this process's last batch with
  its rows cycled or cut to that size). Inactive replicas
  contribute zero gradients (``divide_by_initial_world_size=True``, torch's default,
  keeps dividing by the full replica count; ``False`` divides by the number of active
  replicas) and keep their buffers.
- :meth:`DDPJoinHook.post_hook` takes the final model from the highest-ranked of the
  last processes to join (torch's ``_sync_final_model``): parameters always, buffers
  when DDP broadcasts buffers. With ``train_step`` the replays applied the same update
  everywhere and this changes nothing; with ``value_and_grad`` and an optimizer
  applied by hand, the processes that joined early get the trained parameters.

A process with no step at all inside the context (torch's mapping where a rank has no
input) has nothing of its own to replay: it answers the flags all-reduce with a "no
step" flag, and then the highest-ranked process still training broadcasts its current
call (the step's number, batch and extra arguments; steps are numbered as the wrappers
make them, in the same order on every process) to it. That costs one object broadcast,
once, and only then. A step this process never made (a step made inside the loop, which
a process without inputs never runs) raises :class:`~jdist.errors.JoinError` on every
process, naming the rank (one more small all-reduce decides it together), instead of
leaving the processes still training to wait in their step until the group's timeout.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist import collectives
from jdist.algorithms.join import Join, Joinable, JoinConfig, JoinHook
from jdist.ddp._program import JoinMode, _broadcast_from
from jdist.errors import JoinError

__all__ = ["Join", "JoinState", "DDPJoinHook", "JoinableDDP", "StepNumbers", "NO_STEP_MSG",
           "MISSING_STEP_MSG", "batch_rows", "with_rows"]

NO_STEP_MSG = (
    "rank {src} runs a DDP step that was not made by ddp.train_step / ddp.value_and_grad "
    "of this wrapper, so the processes without inputs cannot replay it; make the step "
    "with those methods on every process")
MISSING_STEP_MSG = (
    "rank {rank} ran no DDP step inside the join context and has not made step #{number} "
    "that the other processes run (steps are numbered in the order ddp.train_step / "
    "ddp.value_and_grad make them): make the same steps, in the same order, on every "
    "process before the join context (step = ddp.value_and_grad(loss_fn) before the "
    "loop, not ddp.value_and_grad(loss_fn)(batch) inside it)")


class StepNumbers:
    """The step callables a DDP wrapper made, numbered in making order (weakly held)."""

    def __init__(self) -> None:
        self._count = itertools.count()
        self._by_number: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def add(self, step: Any) -> None:
        k = next(self._count)
        self._by_number[k] = step
        self._numbers[step] = k

    def number(self, step: Any) -> int | None:
        return self._numbers.get(step)

    def get(self, number: int) -> Any:
        return self._by_number.get(number)


_DISABLED = JoinConfig.construct_disabled_join_config()


class JoinState:
    """The engine's view of an enabled join context (``engine.join_state``)."""

    def __init__(self, engine: Any, mode: JoinMode, notify: Any, steps: StepNumbers):
        self.engine = engine
        self.mode = mode
        self.rank = engine.group.rank
        self.notify = notify
        self.steps = steps
        self.active = True  # False once this process shadows the others' steps
        self.last: Any = None  # (step, batch, args) of this process's last step
        self.n_active: int | None = None

    def before_step(self, step: Any, batch: Any, args: tuple) -> None:
        """Called by the engine at the start of every DDP step inside the context."""
        if not self.active:  # a replay: the hook already exchanged the flags
            return
        self.notify()
        e = self.engine
        self.exchange(e.require_backward_grad_sync, e.sync_buffers, (step, batch, args))
        self.last = (step, batch, args)

    def exchange(self, sync: bool, sync_buffers: bool, call: Any = None) -> np.ndarray:
        """MAX all-reduce of ``[sync, sync_buffers, rank + 1 of a process without a step,
        rank of a process still training, its batch rows]``; when some process has no
        step, the highest training one then broadcasts ``call`` (its current step call)
        to it."""
        missing = not self.active and self.last is None
        flags = [float(sync), float(sync_buffers), float(self.rank + 1) if missing else 0.0,
                 float(self.rank) if self.active else -1.0,
                 float(batch_rows(call[1])) if self.active else -1.0]
        out = np.asarray(collectives.all_reduce(
            np.asarray(flags, np.float32), op=collectives.ReduceOp.MAX,
            group=self.engine.group))
        if out[2] > 0:
            self._share_step(int(out[3]), call)
        return out

    def _share_step(self, src: int, call: Any) -> None:
        payload = [None]
        if self.rank == src:
            step, batch, args = call
            payload = [(self.steps.number(step), batch, args)]
        collectives.broadcast_object_list(payload, group_src=src, group=self.engine.group)
        number, batch, args = payload[0]
        if number is None:  # on every process: nobody can replay it
            raise JoinError(NO_STEP_MSG.format(src=src))
        step = None
        if not self.active and self.last is None:
            step = self.steps.get(number)
        # every process learns whether each one without a step can replay it: one MAX
        # all-reduce, so that the processes still training raise with it instead of
        # waiting in their step for a partner that raised (until the group's timeout)
        cannot = float(self.rank + 1) if (not self.active and self.last is None
                                          and step is None) else 0.0
        worst = int(np.asarray(collectives.all_reduce(
            np.asarray([cannot], np.float32), op=collectives.ReduceOp.MAX,
            group=self.engine.group))[0])
        if worst:
            raise JoinError(MISSING_STEP_MSG.format(rank=worst - 1, number=number))
        if step is not None:
            self.last = (step, batch, args)

    def after_step(self, n_active: int, num_replicas: int) -> None:
        """Called by the engine after every join-mode step: the active replica count."""
        del num_replicas
        self.n_active = n_active


class DDPJoinHook(JoinHook):
    """DDP's join hook: replay the last step inactive; at the end, take the final model
    from a last joiner."""

    def __init__(self, ddp: Any, state: JoinState):
        self.ddp = ddp
        self.state = state

    def main_hook(self) -> None:
        state, engine = self.state, self.ddp._engine
        state.active = False
        flags = state.exchange(False, False)
        step, batch, args = state.last
        # the others' batch size (their last batch may be smaller): the replayed step
        # must be the same program; this process's rows only need the right shape
        batch = with_rows(batch, int(flags[4]))
        old = engine.require_backward_grad_sync
        engine.require_backward_grad_sync = bool(flags[0])
        engine.last_synced = bool(flags[1]) or not engine.broadcast_buffers
        try:
            step(batch, *args)
        finally:
            engine.require_backward_grad_sync = old

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        group = ddp._engine.group
        mine = np.asarray([group.rank if is_last_joiner else -1], np.int32)
        src = int(np.asarray(collectives.all_reduce(
            mine, op=collectives.ReduceOp.MAX, group=group))[0])
        ddp._authoritative_rank = src
        params, buffers = ddp._model_trees()
        params = sync_from(group, params, src)
        if ddp._engine.broadcast_buffers and jax.tree.leaves(buffers):
            buffers = sync_from(group, buffers, src)
        else:
            buffers = None
        ddp._load_model_trees(params, buffers)
        ddp._engine.checks.seen(params)  # DDP's own values: no drift check for them


def batch_rows(batch: Any) -> int:
    """The leading size of ``batch``'s first leaf (-1 for none or a scalar)."""
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else -1


def with_rows(batch: Any, rows: int) -> Any:
    """``batch`` with ``rows`` rows: its own, cycled or cut (unchanged when it has them)."""
    have = batch_rows(batch)
    if rows < 0 or have == rows:
        return batch
    if have <= 0:
        raise JoinError(f"cannot replay an empty batch as one of {rows} rows: the last "
                        "batch of this process inside the join context had no rows")
    take = np.arange(rows) % have
    return jax.tree.map(lambda x: np.take(np.asarray(x), take, axis=0), batch)


@functools.lru_cache(maxsize=16)
def _from_program(mesh: Any, axis: str):
    def body(tree, src):
        return _broadcast_from(tree, axis, src)

    # without type checks: the replicas of a "replicated" input may differ here, which
    # is what this program repairs
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                                 check_vma=False))


def sync_from(group: Any, tree: Any, src: int) -> Any:
    """Every process gets process ``src``'s values of ``tree`` (global arrays replicated
    over ``group``'s devices, as DDP steps leave them)."""
    if group.size() == 1 or not jax.tree.leaves(tree):
        return tree
    from jdist.ddp._placement import replicated

    first = group.devices_per_rank[src][0]
    index = list(group.mesh.devices.flat).index(first)
    return _from_program(group.mesh, group.axis_name)(replicated(tree, group),
                                                      np.int32(index))


class JoinableDDP(Joinable):
    """The :class:`Joinable` side of the DDP wrappers (mixed into ``EngineShell``).

    The wrappers implement ``_model_trees()`` / ``_load_model_trees(params, buffers)``
    (their parameters and buffers as DDP steps leave them) for the post-hook.
    """

    _engine: Any
    process_group: Any

    @property
    def _join_config(self) -> JoinConfig:
        return self.__dict__.get("_jdist_join_config", _DISABLED)

    @_join_config.setter
    def _join_config(self, config: JoinConfig) -> None:
        engine = self._engine
        if config.enable:
            state = self.__dict__.pop("_jdist_join_pending", None) or self._join_state(True)
            if engine.join_state is not None and engine.join_state is not state:
                raise JoinError("this DDP module is already inside a join context; join "
                                "contexts cannot be nested")
            engine.join_state = state
        else:
            self.__dict__.pop("_jdist_join_pending", None)
            engine.join_state = None
        self.__dict__["_jdist_join_config"] = config

    def _join_state(self, divide_by_initial_world_size: bool) -> JoinState:
        mode = JoinMode(bool(divide_by_initial_world_size), False)
        return JoinState(self._engine, mode, lambda: Join.notify_join_context(self),
                         self._join_steps)

    @property
    def _join_steps(self) -> StepNumbers:
        return self.__dict__.setdefault("_jdist_join_steps", StepNumbers())

    def _joinable_step(self, step: Any) -> Any:
        """Number a step callable as the wrapper makes it (see :class:`StepNumbers`);
        returns it."""
        self._join_steps.add(step)
        return step

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """DDP's hook; reads ``divide_by_initial_world_size`` (default ``True``)."""
        state = self._join_state(kwargs.get("divide_by_initial_world_size", True))
        self.__dict__["_jdist_join_pending"] = state
        return DDPJoinHook(self, state)

    @property
    def join_device(self) -> Any:
        return self.process_group.local_devices[0]

    @property
    def join_process_group(self) -> Any:
        return self.process_group
