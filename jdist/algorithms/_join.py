"""The generic join context manager: uneven inputs across processes (torch's Join).

Every process runs the same training loop over its own inputs, and the inputs may run
out at different iterations. Each iteration, every :class:`Joinable` runs its
collectives; the first joinable of the context first calls
:meth:`Join.notify_join_context`, which all-reduces a 1 (this process has not joined).
A process out of inputs leaves its loop and enters :meth:`Join.__exit__`, where it
repeats, until no process is left with inputs:

1. all-reduce a 0: the sum is the number of processes that still have inputs (the
   partner of their notification);
2. if it is not 0, run every joinable's :meth:`JoinHook.main_hook`, in the order the
   joinables were given, which *shadows* that joinable's per-iteration collectives so
   that the processes still training find a partner for each of them.

Then every process runs each :meth:`JoinHook.post_hook` once, told whether it was one
of the last processes to join (DDP uses it to take the final model from such a
process). The collectives are jdist's eager ones on the joinables' common
``join_process_group``; a process that never reaches a partner fails with that
collective's timeout, which names it.

``throw_on_early_termination=True``: the first process out of inputs all-reduces a 1 a
second time and raises ``JoinError("Rank r exhausted all inputs.")``; every other
process sees it in the second all-reduce of its next notification and raises
``JoinError("Detected at least one rank that exhausted inputs. Throwing across all
ranks.")`` before that iteration's collectives. :class:`~jdist.errors.JoinError` is a
``RuntimeError``, the class torch raises.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np

from jdist.errors import JoinError

__all__ = ["Join", "JoinConfig", "JoinHook", "Joinable", "EXHAUSTED_MSG", "DETECTED_MSG",
           "LEFT_OUT_MSG", "WARN_THRESHOLD"]

EXHAUSTED_MSG = "Rank {rank} exhausted all inputs."
DETECTED_MSG = "Detected at least one rank that exhausted inputs. Throwing across all ranks."
WARN_THRESHOLD = 1000
"""Iterations a joined process shadows before :class:`Join` warns of the skew (torch's)."""


class JoinHook:
    """Two entry points a :class:`Joinable` gives the join context manager.

    Subclass it and override what the joinable needs: :meth:`main_hook` runs once per
    iteration of the processes still training, :meth:`post_hook` once at the end.
    """

    def main_hook(self) -> None:
        """Shadow one training iteration's collectives of this joinable (forward,
        backward, optimizer step) while some process has not joined."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once every process has joined; ``is_last_joiner`` is ``True`` on the
        processes that were among the last to join."""


class JoinConfig(NamedTuple):
    """What :class:`Join` tells each of its joinables (torch's ``_JoinConfig``)."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def construct_disabled_join_config() -> JoinConfig:
        """The config outside any join context: join logic off."""
        return JoinConfig(enable=False, throw_on_early_termination=False,
                          is_first_joinable=False)


class Joinable(ABC):
    """Base of the classes a :class:`Join` context manager can drive.

    A joinable calls ``super().__init__()`` (which sets ``_join_config``), calls
    :meth:`Join.notify_join_context` before its per-iteration collectives, and
    implements :meth:`join_hook`, :attr:`join_device` and :attr:`join_process_group`.
    """

    @abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._join_config = JoinConfig.construct_disabled_join_config()

    @abstractmethod
    def join_hook(self, **kwargs) -> JoinHook:
        """The :class:`JoinHook` of this joinable; ``kwargs`` are the keyword arguments
        given to :class:`Join` (the same for every joinable of the context)."""

    @property
    @abstractmethod
    def join_device(self) -> Any:
        """The device of the join collectives (informational in jdist: its eager
        collectives take host arrays and reduce over processes)."""

    @property
    @abstractmethod
    def join_process_group(self) -> Any:
        """The process group of the join collectives (``None``: the default group)."""


def _collectives():
    from jdist import collectives  # floor 1: JAX loads only when a Join is used

    return collectives


class Join:
    """Context manager for training with uneven inputs across processes.

    Args:
      joinables: the participating :class:`Joinable` objects; their hooks run in this
        order, which must be the order of their collectives in one iteration.
      enable: ``False`` turns the context manager off (inputs known to be even).
      throw_on_early_termination: raise on every process as soon as one process runs
        out of inputs, instead of shadowing its collectives.
      **kwargs: passed to every joinable's :meth:`Joinable.join_hook`.

    Example::

      ddp = DistributedDataParallel(model)
      step = ddp.train_step(loss_fn, optimizer)
      with Join([ddp]):
          for batch in my_batches:   # as many as this process has
              step(batch)
    """

    def __init__(self, joinables: list[Joinable], enable: bool = True,
                 throw_on_early_termination: bool = False, **kwargs: Any):
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        self._joinables = list(joinables)
        self._join_hooks = [j.join_hook(**kwargs) for j in self._joinables]
        self._enable = bool(enable)
        self._throw_on_early_termination = bool(throw_on_early_termination)
        self._extract_dist_info()
        self._set_joinable_configs()

    def _set_joinable_configs(self) -> None:
        first = True
        for joinable in self._joinables:
            joinable._join_config = JoinConfig(
                enable=self._enable, throw_on_early_termination=self._throw_on_early_termination,
                is_first_joinable=first)
            first = False

    def _reset_joinable_configs(self) -> None:
        for joinable in self._joinables:
            joinable._join_config = JoinConfig.construct_disabled_join_config()

    def _extract_dist_info(self) -> None:
        """The joinables' common process group, this process's rank in it, and the
        first joinable's device; ``ValueError`` when the groups differ."""
        group, device = None, None
        for i, joinable in enumerate(self._joinables):
            pg = joinable.join_process_group
            if i == 0:
                group = pg
            elif not _same_group(group, pg):
                raise ValueError("Using join context manager with multiple process groups")
            if device is None:
                device = joinable.join_device
        self._process_group = group
        self._device = device
        c = _collectives()
        # a group object knows this process's rank in it (also DDP's embedded group over
        # local devices, which works without init_process_group)
        self._rank = group.rank if isinstance(group, c.ProcessGroup) else c.get_rank(group)

    def __enter__(self) -> Join:
        if self._enable:
            _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Shadow the other processes' iterations until all have joined, then run the
        post-hooks; an exception from the body propagates at once."""
        try:
            if not self._enable or exc_type is not None:
                return
            is_last_joiner = True
            shadowed = 0
            while self._get_num_nonjoined_procs() != 0:
                if self._throw_on_early_termination:
                    self._notify_procs_to_terminate()
                for hook in self._join_hooks:
                    hook.main_hook()
                is_last_joiner = False
                shadowed += 1
                if shadowed == WARN_THRESHOLD + 1:
                    warnings.warn(
                        f"Detected uneven input skew of greater than {WARN_THRESHOLD}. This "
                        f"means that rank {self._rank} has at least {WARN_THRESHOLD} fewer "
                        "inputs than other currently-active ranks. This level of skew could "
                        "lead to performance degradation during training.", stacklevel=2)
            for hook in self._join_hooks:
                hook.post_hook(is_last_joiner)
        finally:
            self._reset_joinable_configs()
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    def _get_num_nonjoined_procs(self) -> int:
        """Shadow the notification all-reduce: the number of processes with inputs."""
        count = _collectives().all_reduce(np.zeros(1, np.float32), group=self._process_group)
        return int(round(float(np.asarray(count)[0])))

    def _notify_procs_to_terminate(self) -> None:
        """Tell the processes still training to stop, and raise here."""
        _collectives().all_reduce(np.ones(1, np.float32), group=self._process_group)
        raise JoinError(EXHAUSTED_MSG.format(rank=self._rank))

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Any:
        """Tell the context manager this process has not joined (call it before each
        iteration's collectives). Only the first joinable of the context communicates:
        it all-reduces a 1 and, with ``throw_on_early_termination``, raises
        :class:`~jdist.errors.JoinError` when another process has run out of inputs.

        Returns the completed ``Work`` of the notification for the first joinable of an
        enabled context, else ``None``.
        """
        if not hasattr(joinable, "_join_config"):
            raise AssertionError(
                f"Check that the {type(joinable)} constructor calls the ``Joinable`` "
                "constructor")
        config = joinable._join_config
        if not config.enable:
            _check_not_left_out(joinable)
            return None
        if not config.is_first_joinable:
            return None
        c = _collectives()
        group = joinable.join_process_group
        # blocking (torch's is async): the next program this process launches must not
        # overtake it, as collectives pair up across processes in launch order
        ones = c.all_reduce(np.ones(1, np.float32), group=group)
        work = c.Work.done(ones, "Join.notify_join_context all_reduce")
        if config.throw_on_early_termination:
            flag = c.all_reduce(np.zeros(1, np.float32), group=group)
            if float(np.asarray(flag)[0]) != 0.0:
                raise JoinError(DETECTED_MSG)
        return work


_ACTIVE: list = []  # the enabled join contexts this process is inside, innermost last

LEFT_OUT_MSG = (
    "{what} ran its collectives inside a join context that does not list it (the "
    "context's joinables: {listed}). When a process runs out of inputs, the context "
    "shadows only the collectives of the joinables it lists, so the processes still "
    "training would wait for this one's partners until the timeout. List every joinable "
    "whose collectives run in the loop, in their order, e.g. `with Join([ddp, zero]):` "
    "instead of `with ddp.join():` (jdist.algorithms.join.Join; torch requires the "
    "same, and hangs without it).")


def _check_not_left_out(joinable: Any) -> None:
    """Raise :class:`~jdist.errors.JoinError` when ``joinable`` communicates inside an
    enabled join context on its group that does not list it (it would hang there)."""
    for ctx in _ACTIVE:
        if joinable in ctx._joinables or not _same_group(
                ctx._process_group, joinable.join_process_group):
            continue
        raise JoinError(LEFT_OUT_MSG.format(
            what=type(joinable).__name__,
            listed=", ".join(type(j).__name__ for j in ctx._joinables)))


def _same_group(a: Any, b: Any) -> bool:
    """Whether two ``join_process_group`` values name one group (``None``: default)."""
    if a is b:
        return True
    if a is None or b is None:
        c = _collectives()
        if not c.is_initialized():
            return False
        default = c.get_default_group()
        return (a if a is not None else default) == (b if b is not None else default)
    return a == b
