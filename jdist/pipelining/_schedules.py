"""torch's pipeline schedules over :class:`PipelineStage` objects of one process.

A schedule holds its stages, the number of micro-batches and the loss; ``step(*args,
target=, losses=)`` splits the batch (``split_args_kwargs_into_chunks``), runs the
actions of :attr:`pipeline_order` (``jdist/pipelining/_orders.py``, torch's orders), and
returns the last stage's outputs merged back into one batch; ``losses`` (a list) gets
each micro-batch's loss. Each stage's :attr:`~PipelineStage.grads` then holds its
gradients, averaged over the micro-batches (``scale_grads=True``, torch's default) or
summed.

When every stage is in this process (on its devices, ``PipelineStage(device=)``), the
ranks of the order are walked together, each rank's next action running as soon as its
inputs exist. Otherwise each process holds the stages of its pipeline rank (``s % pp``)
and runs its own list (``jdist/pipelining/_remote.py``), its messages on jdist's
mailbox or XLA's point-to-point (``transport=``, ``jdist/pipelining/_sockets.py``
chooses). With ``dp_group=`` (the ranks
holding the same stages in other pipeline replicas), each stage's gradients are then
averaged over its replicas: data parallel x pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jdist.pipelining._actions import Action, Kind
from jdist.pipelining._links import Links
from jdist.pipelining._microbatch import merge_chunks, split_args_kwargs_into_chunks
from jdist.pipelining._orders import ORDERS
from jdist.pipelining._remote import average_over, raise_in, run_rank
from jdist.pipelining._sockets import TRANSPORTS, SocketLinks, choose_transport, next_schedule_id
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
    idx = [s.stage_index for s in out]
    if len(set(idx)) != len(idx):
        raise ValueError(f"stage indices repeat: {sorted(idx)}")
    return sorted(out, key=lambda s: s.stage_index)


def _layout(stages: list[PipelineStage], pp_size, one_stage_per_rank: bool, name: str,
            group):
    """``(pp, my pipeline rank or None, group)``: None when every stage is here."""
    n = stages[0].num_stages
    if len(stages) == n:
        pp = pp_size if pp_size is not None else (n if one_stage_per_rank else 1)
        if not isinstance(pp, int) or pp < 1 or n % pp:
            raise ValueError(f"{name}: pp_size {pp!r} must divide the {n} stages (stage s "
                             f"runs on rank s % pp_size)")
        return pp, None, None
    import jdist

    if not jdist.is_initialized():
        raise ValueError(f"{name}: this process has stages "
                         f"{[s.stage_index for s in stages]} of {n}; either build every "
                         f"stage here, or call jdist.init_process_group() in every process "
                         f"of the pipeline")
    group = group if group is not None else jdist.get_default_group()
    pp, me = group.size(), group.rank
    if pp_size is not None and pp_size != pp:
        raise ValueError(f"{name}: pp_size={pp_size} but the pipeline group has {pp} ranks")
    want = list(range(me, n, pp))
    if n % pp or [s.stage_index for s in stages] != want:
        raise ValueError(f"{name}: pipeline rank {me} of {pp} must hold stages {want} (stage "
                         f"s runs on rank s % {pp}), got {[s.stage_index for s in stages]}")
    return pp, me, group


class _Schedule:
    """The shared shell: validation, micro-batching and the action loop."""

    order_name = ""
    one_stage_per_rank = False

    def __init__(self, stages, n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True, pp_size: int | None = None, group=None,
                 dp_group=None, transport: str = "auto") -> None:
        self._stages = _stages(stages)
        self.dp_group = dp_group
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}; choose one of {TRANSPORTS}")
        self.transport, self._chosen, self._steps, self._id = transport, False, 0, None
        n = self._stages[0].num_stages
        self.pp_size, self._rank, self._group = _layout(
            self._stages, pp_size, self.one_stage_per_rank, type(self).__name__, group)
        self.n_microbatches = n_microbatches
        self.loss_fn, self.scale_grads = loss_fn, scale_grads
        self.pipeline_order: dict[int, list[Action | None]] = ORDERS[self.order_name](
            self.pp_size, n // self.pp_size, n_microbatches)
        if self._rank is not None:  # (schedules on a group are built in the same order)
            self._id = next_schedule_id(self._group)

    def step(self, *args, target: Any = None, losses: list | None = None, **kwargs):
        """One training step; returns the last stage's output for the whole batch."""
        return self._run(args, kwargs, target, losses, train=True)

    def eval(self, *args, target: Any = None, losses: list | None = None, **kwargs):
        """Forward only (no gradients); returns the last stage's output."""
        return self._run(args, kwargs, target, losses, train=False)

    def _run(self, args, kwargs, target, losses, train: bool):
        m, first = self.n_microbatches, self._stages[0]
        holds_first, holds_last = first.stage_index == 0, self._stages[-1].is_last
        problem = _problem(holds_first, holds_last, args, kwargs, target, self.loss_fn,
                           train and self._rank is not None)
        chunks = targets = None
        if problem is None:
            try:
                chunks, targets = _split(args, kwargs, target, m, holds_first, holds_last)
            except ValueError as exc:  # (across processes: every rank is told, below)
                if self._rank is None:
                    raise
                problem = str(exc)
        if self._rank is None:
            if problem is not None:
                raise ValueError(problem)
            backward = train and self.loss_fn is not None and target is not None
        else:
            backward = train and self.loss_fn is not None
        for st in self._stages:
            st.begin(self.loss_fn)
        if self._rank is None:
            run = _Run(self._stages, chunks, targets, self.loss_fn, backward)
            run.drive(self.pipeline_order)
            outputs, step_losses = run.outputs[len(self._stages) - 1], run.losses
        else:
            done = self._run_here(chunks, targets, backward, problem)
            outputs, step_losses = done.outputs, done.losses
        for st in self._stages if backward else ():
            st.finish(m if self.scale_grads else 1)
            if self.dp_group is not None:
                st.grads = average_over(st.grads, self.dp_group)
        if not holds_last:
            return None
        if losses is not None and target is not None:
            losses.extend(step_losses[i] for i in range(m))
        return merge_chunks([outputs[i] for i in range(m)])

    def _run_here(self, chunks, targets, backward: bool, problem: str | None):
        import jdist

        group, timeout = self._group, self._group.timeout
        if not self._chosen:  # the first step: every rank of the group is here
            self.transport, self._chosen = choose_transport(self.transport, group), True
        self._steps += 1
        tag = f"{group.name}/{self._id}/{self._steps}"  # the same on every rank
        if self.transport == "socket":
            def make_links(sends, recvs):
                return SocketLinks(group, tag, sends, recvs, timeout)
        else:
            def make_links(sends, recvs):
                return Links(jdist, group, sends, recvs, timeout, tag)
        return run_rank(make_links, self._rank, self.pipeline_order,
                        {s.stage_index: s for s in self._stages},
                        self._stages[0].num_stages, chunks, targets, self.loss_fn,
                        backward, timeout, problem)


def _problem(holds_first: bool, holds_last: bool, args, kwargs, target, loss_fn,
             needs_target: bool) -> str | None:
    """What is wrong with a step's arguments on this rank (None: nothing)."""
    if holds_first and not args:
        return "the rank holding stage 0 passes the step's inputs: schedule.step(x, ...)"
    if kwargs:
        return f"pipeline stages take positional inputs only; pass {sorted(kwargs)} " \
               f"positionally"
    if target is not None and loss_fn is None:
        return "a target needs the schedule's loss_fn; pass loss_fn="
    if needs_target and holds_last and loss_fn is not None and target is None:
        return ("the rank holding the last stage passes the target: "
                "schedule.step(target=y, losses=...)")
    return None


def _split(args, kwargs, target, m: int, holds_first: bool, holds_last: bool):
    """This rank's micro-batches of the inputs and of the target."""
    chunks = split_args_kwargs_into_chunks(args, kwargs, m)[0] if holds_first else [()] * m
    targets = [t[0] for t in split_args_kwargs_into_chunks((target,), None, m)[0]] \
        if target is not None and holds_last else [None] * m
    if holds_first and holds_last:
        _same_rows(chunks, targets)
    return chunks, targets


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
            raise_in(exc, f"pipeline stage {s}, action {a} (micro-batch {i}): {exc}")
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
