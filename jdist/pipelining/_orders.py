"""Pipeline schedules as pure data: each rank's list of actions (``None`` = idle slot).

Every function takes the pipeline size ``pp`` (ranks), the stages each rank holds
(``n_local``; stage ``s`` lives on rank ``s % pp``) and the micro-batch count ``m``, and
returns ``{rank: [Action | None, ...]}``. The lists are torch's
(``torch.distributed.pipelining``'s ``pipeline_order``), compared action for action by
``tests/pipelining/test_orders.py`` over a grid of sizes:

- ``gpipe``: every forward, then every backward (one stage per rank);
- ``one_f_one_b``: ``pp - 1 - rank`` warm-up forwards, then one forward and one
  backward in turn, then the remaining backwards;
- ``looped_bfs``: several stages per rank, all micro-batches of the earliest stage first;
- ``interleaved_1f1b``: several stages per rank, depth first, in rounds of
  ``m // max(1, m // pp)`` micro-batches;
- ``interleaved_zero_bubble``: the same with backward split into input (``I``) and
  weight (``W``) gradients, the weight ones filling what would be bubbles (ZB1P), then
  idle slots inserted wherever a rank would run ahead of its inputs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from jdist.pipelining._actions import Action, Kind

__all__ = ["gpipe", "one_f_one_b", "looped_bfs", "interleaved_1f1b",
           "interleaved_zero_bubble", "ORDERS", "check_sizes"]

Order = dict[int, list[Action | None]]


def check_sizes(name: str, pp: int, n_local: int, m: int) -> None:
    """Raise ValueError (naming the fix) for sizes schedule ``name`` cannot run."""
    for what, v in (("pipeline size", pp), ("stages per rank", n_local),
                    ("micro-batch count", m)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: the {what} must be a positive int, got {v!r}")
    if name in ("gpipe", "one_f_one_b") and n_local != 1:
        raise ValueError(f"{name} runs one stage per rank, got {n_local} per rank; use "
                         f"ScheduleInterleaved1F1B or ScheduleLoopedBFS for several")
    if name == "one_f_one_b" and m < pp:
        raise ValueError(f"Number of microbatches ({m}) must be greater than or equal to "
                         f"the number of stages ({pp}) for 1F1B; split the batch into at "
                         f"least {pp} micro-batches")
    if name in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(f"{name}: the micro-batch count ({m}) must be a multiple of "
                             f"the number of rounds ({rounds} = max(1, {m} // {pp}))")


def gpipe(pp: int, n_local: int, m: int) -> Order:
    check_sizes("gpipe", pp, n_local, m)
    return {r: [None] * r + [Action(r, Kind.FORWARD, i) for i in range(m)]
            + [None] * (3 * (pp - 1 - r)) + [Action(r, Kind.BACKWARD, i) for i in range(m)]
            for r in range(pp)}


def one_f_one_b(pp: int, n_local: int, m: int) -> Order:
    check_sizes("one_f_one_b", pp, n_local, m)
    out: Order = {}
    for r in range(pp):
        warm = pp - 1 - r
        ops: list[Action | None] = [None] * r
        ops += [Action(r, Kind.FORWARD, i) for i in range(warm)]
        ops += [None] * (2 * warm)
        for i in range(m - warm):  # steady state: forward warm + i, backward i
            ops += [Action(r, Kind.FORWARD, warm + i), Action(r, Kind.BACKWARD, i)]
        for i in range(m - warm, m):
            ops += [None, Action(r, Kind.BACKWARD, i)]
        out[r] = ops
    return out


def looped_bfs(pp: int, n_local: int, m: int) -> Order:
    check_sizes("looped_bfs", pp, n_local, m)
    out: Order = {}
    for r in range(pp):
        stages = [r + k * pp for k in range(n_local)]
        ops: list[Action | None] = [None] * r
        ops += [Action(s, Kind.FORWARD, i) for s in stages for i in range(m)]
        ops += [None] * (2 * (pp - 1 - r))
        ops += [Action(s, Kind.BACKWARD, i) for s in reversed(stages)
                for i in reversed(range(m))]
        out[r] = ops
    return out


class _Rank:
    """The 1F1B-family list of one rank: forwards and backwards of stages chosen per op
    number, each stage's micro-batches counted in order."""

    def __init__(self, r: int, pp: int, n_local: int, m: int, warmup: int) -> None:
        self.r, self.pp, self.n_local, self.warmup = r, pp, n_local, warmup
        self.per_round = m // max(1, m // pp)
        self.count: dict[tuple[Kind, int], int] = defaultdict(int)
        self.ops: list[Action | None] = [None] * r

    def fwd_stage(self, k: int) -> int:
        return (k // self.per_round) % self.n_local * self.pp + self.r

    def bwd_stage(self, k: int) -> int:
        local = self.n_local - 1 - ((k - self.warmup) // self.per_round) % self.n_local
        return local * self.pp + self.r

    def add(self, kind: Kind, stage: int) -> None:
        self.ops.append(Action(stage, kind, self.count[kind, stage]))
        self.count[kind, stage] += 1


def _interleaved_rank(r: int, pp: int, n_local: int, m: int, zero_bubble: bool):
    per_round = m // max(1, m // pp)
    spread = 1 if zero_bubble else 2
    warmup = min((n_local - 1) * per_round + spread * (pp - 1 - r), n_local * m)
    rk = _Rank(r, pp, n_local, m, warmup)
    idle_after_warmup = (pp - r - 1 if zero_bubble
                         else n_local * pp + 2 * (pp - 1 - r) - (warmup + r))
    back = Kind.BACKWARD_INPUT if zero_bubble else Kind.BACKWARD
    done: list[int] = []  # op numbers of the backwards so far (for their weight halves)
    weights = 0
    for k in range(n_local * m + warmup):  # warm-up, steady (1F1B), cool-down ops
        if k < warmup:
            rk.add(Kind.FORWARD, rk.fwd_stage(k))
            if k == warmup - 1:
                rk.ops += [None] * idle_after_warmup
            continue
        if k < n_local * m:
            rk.add(Kind.FORWARD, rk.fwd_stage(k))
        elif not zero_bubble:
            rk.ops.append(None)
        rk.add(back, rk.bwd_stage(k))
        done.append(k)
        if zero_bubble and k - warmup >= r:  # ZB1P: rank r delays its weights by r ops
            rk.add(Kind.BACKWARD_WEIGHT, rk.bwd_stage(done[weights]))
            weights += 1
    while zero_bubble and weights < len(done):
        rk.add(Kind.BACKWARD_WEIGHT, rk.bwd_stage(done[weights]))
        weights += 1
    return rk.ops


def interleaved_1f1b(pp: int, n_local: int, m: int) -> Order:
    check_sizes("interleaved_1f1b", pp, n_local, m)
    return {r: _interleaved_rank(r, pp, n_local, m, False) for r in range(pp)}


def _needs_idle(a: Action, last_stage: int, seen: set) -> bool:
    """Whether ``a`` would run before its input exists (torch's bubble rule: forwards
    wait for the previous stage's forward, full backwards for the next stage's)."""
    if a.kind is Kind.FORWARD:
        return a.stage != 0 and (a.stage - 1, Kind.FORWARD, a.microbatch) not in seen
    if a.kind is Kind.BACKWARD:
        if a.stage == last_stage:
            return (a.stage, Kind.FORWARD, a.microbatch) not in seen
        return (a.stage + 1, Kind.BACKWARD, a.microbatch) not in seen
    return False


def _with_idle_slots(order: Order, n_stages: int) -> Order:
    """``order`` with idle slots where an action's input is not made in an earlier slot
    (slot by slot over all ranks; what a slot makes is usable from the next slot)."""
    out: Order = {r: [] for r in order}
    at = dict.fromkeys(order, 0)
    seen: set = set()
    while any(at[r] < len(order[r]) for r in order):
        made = set()
        for r, ops in order.items():
            if at[r] >= len(ops):
                continue
            a = ops[at[r]]
            if a is not None and _needs_idle(a, n_stages - 1, seen):
                out[r].append(None)
                continue
            out[r].append(a)
            at[r] += 1
            if a is not None:
                made.add((a.stage, a.kind, a.microbatch))
        seen |= made
    return out


def interleaved_zero_bubble(pp: int, n_local: int, m: int) -> Order:
    check_sizes("interleaved_zero_bubble", pp, n_local, m)
    raw = {r: _interleaved_rank(r, pp, n_local, m, True) for r in range(pp)}
    return _with_idle_slots(raw, pp * n_local)


ORDERS: dict[str, Callable[[int, int, int], Order]] = {
    "gpipe": gpipe, "one_f_one_b": one_f_one_b, "looped_bfs": looped_bfs,
    "interleaved_1f1b": interleaved_1f1b,
    "interleaved_zero_bubble": interleaved_zero_bubble,
}
