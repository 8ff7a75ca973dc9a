"""torch's pipeline schedules over :class:`PipelineStage` objects of one process.

A schedule holds its stages, the number of micro-batches and the loss; ``step(*args,
target=, losses=)`` splits the batch (``split_args_kwargs_into_chunks``), runs the
actions of :attr:`pipeline_order` (``jdist/pipelining/_orders.py``, torch's orders), and
returns the last stage's outputs merged back into one batch; ``losses`` (a list) gets
each micro-batch's loss. Each stage's :attr:`~PipelineStage.grads` then holds its
gradients, averaged over the micro-batches (``scale_grads=True``, torch's default) or
summed.

Every stage runs in this process (on this process's devices, ``PipelineStage(device=)``):
the ranks of the order are walked together, each rank's next action running as soon as
its inputs exist. A schedule whose stages are not all here raises; stages in separate
processes are not built yet (docs/pipelining.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jdist.pipelining._actions import Action, Kind
from jdist.pipelining._microbatch import merge_chunks, split_args_kwargs_into_chunks
from jdist.pipelining._orders import ORDERS
from jdist.pipelining._stage import PipelineStage

__all__ = ["ScheduleGPipe", "Schedule1F1B", "ScheduleLoopedBFS", "ScheduleInterleaved1F1B",
           "ScheduleInterleavedZeroBubble", "get_schedule_class"]


def _stages(stages: PipelineStage | Sequence[PipelineStage]) -> list[PipelineStage]:
    out = [stages] if isinstance(stages, PipelineStage) else list(stages)
    if not out or not all(isinstance(s, PipelineStage) for s in out):
        raise ValueError(f"a schedule needs PipelineStage objects, got {stages!r}")
    n = {s.num_stages for s in out}
    if len(n) != 1:
        raise ValueError(f"the stages disagree on num_stages: {sorted(n)}")
    have = sorted(s.stage_index for s in out)
    if have != list(range(n.pop())):
        raise ValueError(
            f"jdist.pipelining runs every stage of a pipeline in one process; this "
            f"process has stages {have} of {out[0].num_stages}. Build a PipelineStage for "
            f"each stage here (each may sit on its own device) and pass them all")
    return sorted(out, key=lambda s: s.stage_index)


class _Schedule:
    """The shared shell: validation, micro-batching and the action loop."""

    order_name = ""
    one_stage_per_rank = False

    def __init__(self, stages, n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True, pp_size: int | None = None) -> None:
        self._stages = _stages(stages)
        n = len(self._stages)
        pp = pp_size if pp_size is not None else (n if self.one_stage_per_rank else 1)
        if not isinstance(pp, int) or pp < 1 or n % pp:
            raise ValueError(f"{type(self).__name__}: pp_size {pp!r} must divide the "
                             f"{n} stages (stage s runs on rank s % pp_size)")
        self.pp_size, self.n_microbatches = pp, n_microbatches
        self.loss_fn, self.scale_grads = loss_fn, scale_grads
        self.pipeline_order: dict[int, list[Action | None]] = ORDERS[self.order_name](
            pp, n // pp, n_microbatches)

    def step(self, *args, target: Any = None, losses: list | None = None, **kwargs):
        """One training step; returns the last stage's output for the whole batch."""
        return self._run(args, kwargs, target, losses, train=True)

    def eval(self, *args, target: Any = None, losses: list | None = None, **kwargs):
        """Forward only (no gradients); returns the last stage's output."""
        return self._run(args, kwargs, target, losses, train=False)

    def _run(self, args, kwargs, target, losses, train: bool):
        m = self.n_microbatches
        chunks, kw = split_args_kwargs_into_chunks(args, kwargs, m)
        if any(kw):
            raise ValueError("pipeline stages take positional inputs only; pass "
                             f"{sorted(kw[0])} positionally")
        if target is not None and self.loss_fn is None:
            raise ValueError("a target needs the schedule's loss_fn; pass loss_fn=")
        targets = (split_args_kwargs_into_chunks((target,), None, m)[0]
                   if target is not None else [(None,)] * m)
        _same_rows(chunks, targets)
        backward = train and self.loss_fn is not None and target is not None
        run = _Run(self._stages, chunks, [t[0] for t in targets], self.loss_fn, backward)
        for st in self._stages:
            st.begin(self.loss_fn)
        run.drive(self.pipeline_order)
        for st in self._stages if backward else ():
            st.finish(m if self.scale_grads else 1)
        if losses is not None and target is not None:
            losses.extend(run.losses[i] for i in range(m))
        return merge_chunks([run.outputs[len(self._stages) - 1][i] for i in range(m)])


def _same_rows(chunks: list, targets: list) -> None:
    for i, (c, t) in enumerate(zip(chunks, targets, strict=True)):
        rows = {leaf.shape[0] for leaf in jax.tree.leaves((c, t)) if getattr(leaf, "ndim", 0)}
        if len(rows) > 1:
            raise ValueError(f"micro-batch {i}: the inputs and target have different "
                             f"numbers of rows {sorted(rows)}; give every array the same "
                             f"batch size")


class _Run:
    """One step's data: outputs and input-gradients per (stage, micro-batch)."""

    def __init__(self, stages, chunks, targets, loss_fn, backward: bool) -> None:
        self.stages, self.chunks, self.targets = stages, chunks, targets
        self.loss_fn, self.backward = loss_fn, backward
        self.last = len(stages) - 1
        self.outputs: dict[int, dict[int, Any]] = {s: {} for s in range(len(stages))}
        self.grads: dict[int, dict[int, Any]] = {s: {} for s in range(len(stages))}
        self.losses: dict[int, Any] = {}
        self.done: set = set()

    def ready(self, a: Action) -> bool:
        s, i = a.stage, a.microbatch
        if a.kind is Kind.FORWARD:
            return s == 0 or i in self.outputs[s - 1]
        if a.kind is Kind.BACKWARD_WEIGHT:
            return (s, Kind.BACKWARD_INPUT, i) in self.done
        return (i in self.outputs[s]) if s == self.last else (i in self.grads[s + 1])

    def drive(self, order: dict[int, list[Action | None]]) -> None:
        """Run every rank's actions in its order, each once its inputs exist."""
        todo = {r: [a for a in ops if a is not None and (self.backward or
                                                           a.kind is Kind.FORWARD)]
                for r, ops in order.items()}
        at = dict.fromkeys(todo, 0)
        while any(at[r] < len(todo[r]) for r in todo):
            moved = False
            for r, ops in todo.items():
                while at[r] < len(ops) and self.ready(ops[at[r]]):
                    self.act(ops[at[r]])
                    at[r] += 1
                    moved = True
            if not moved:
                raise RuntimeError(f"the schedule cannot progress: the next actions "
                                   f"{[todo[r][at[r]] for r in todo if at[r] < len(todo[r])]}"
                                   f" wait for inputs no action makes")

    def act(self, a: Action) -> None:
        st, s, i = self.stages[a.stage], a.stage, a.microbatch
        try:
            if a.kind is Kind.FORWARD:
                self._forward(st, s, i)
            elif a.kind is Kind.BACKWARD_WEIGHT:
                st.backward_weight(i)
            else:
                ct = None if s == self.last else self.grads[s + 1][i]
                fn = st.backward if a.kind is Kind.BACKWARD else st.backward_input
                self.grads[s][i] = fn(i, None if ct is None else _one(ct))
        except Exception as exc:
            raise type(exc)(f"pipeline stage {s}, action {a} (micro-batch {i}): "
                            f"{exc}") from exc
        self.done.add((s, a.kind, i))

    def _forward(self, st: PipelineStage, s: int, i: int) -> None:
        inputs = self.chunks[i] if s == 0 else self.outputs[s - 1][i]
        target = self.targets[i] if s == self.last else None
        if target is None:
            self.outputs[s][i] = st.forward(i, inputs, with_grad=self.backward)
        elif self.backward:
            self.outputs[s][i], self.losses[i] = st.forward(i, inputs, target)
        else:
            out = st.forward(i, inputs, with_grad=False)
            self.outputs[s][i], self.losses[i] = out, self.loss_fn(out, target)


def _one(ct: tuple):
    """The gradient for the next stage's single input, or the tuple for several."""
    return ct[0] if len(ct) == 1 else ct


class ScheduleGPipe(_Schedule):
    """All forwards, then all backwards (one stage per rank)."""

    order_name, one_stage_per_rank = "gpipe", True


class Schedule1F1B(_Schedule):
    """One forward, one backward in steady state (one stage per rank; needs at least as
    many micro-batches as stages)."""

    order_name, one_stage_per_rank = "one_f_one_b", True


class ScheduleLoopedBFS(_Schedule):
    """Several stages per rank, breadth first."""

    order_name = "looped_bfs"


class ScheduleInterleaved1F1B(_Schedule):
    """Several stages per rank, depth first (Megatron's interleaved 1F1B)."""

    order_name = "interleaved_1f1b"


class ScheduleInterleavedZeroBubble(_Schedule):
    """Interleaved with backward split into input and weight halves (ZB1P)."""

    order_name = "interleaved_zero_bubble"


_BY_NAME = {c.__name__.removeprefix("Schedule").lower(): c
            for c in (ScheduleGPipe, Schedule1F1B, ScheduleLoopedBFS, ScheduleInterleaved1F1B,
                      ScheduleInterleavedZeroBubble)}


def get_schedule_class(name: str) -> type:
    """The schedule class called ``name`` (``"1F1B"``, ``"GPipe"``, ...; any case)."""
    key = str(name).lower().removeprefix("schedule")
    if key not in _BY_NAME:
        raise ValueError(f"no pipeline schedule named {name!r}; choose one of "
                         f"{sorted(c.__name__ for c in _BY_NAME.values())}")
    return _BY_NAME[key]
