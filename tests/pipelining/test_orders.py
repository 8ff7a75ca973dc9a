"""Schedules produce torch's action orders (``jdist/pipelining/_orders.py`` against
``torch.distributed.pipelining``'s ``pipeline_order``, built from stand-in stages as
torch's own ``test_schedule.py`` builds them), over torch's ``TestSchedulePlan`` grid of
(stages per rank, micro-batches, pipeline size) and a grid of its own; and torch's
action text parses and prints back (``TestScheduleLowering.test_action_parse``'s
compute cases)."""

from __future__ import annotations

import itertools

import pytest

from jdist.pipelining import _orders as orders
from jdist.pipelining._actions import Action, Kind, compute_only, parse

torch = pytest.importorskip("torch")
S = pytest.importorskip("torch.distributed.pipelining.schedules")
_base = pytest.importorskip("torch.distributed.pipelining.stage")

# torch's TestSchedulePlan cases: (stages per rank, micro-batches, pipeline size)
TORCH_PLAN = [(2, 2, 2), (2, 4, 4), (2, 8, 2), (2, 8, 4), (2, 8, 8), (4, 4, 4), (4, 8, 4),
              (4, 8, 8), (4, 16, 4), (4, 32, 4), (4, 64, 4), (4, 16, 16), (4, 32, 32),
              (4, 128, 64), (3, 2, 2), (3, 8, 2), (3, 12, 4), (4, 6, 3), (4, 10, 5),
              (2, 3, 4), (2, 4, 4), (2, 10, 4), (2, 15, 4)]
OWN_PLAN = [(n, m, pp) for n, m, pp in itertools.product((1, 2, 3), (1, 2, 3, 4, 5, 6, 8, 9),
                                                          (1, 2, 3, 4))]


class _Stage(_base._PipelineStageBase):
    """A stand-in stage: only what a schedule reads to plan its order."""

    def __init__(self, num_stages: int, group_size: int, stage_index: int = 0) -> None:
        self.submod = None
        self.num_stages, self.group_size, self.group_rank = num_stages, group_size, 0
        self.group, self.stage_index = None, stage_index

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, n_microbatches):
        pass

    def _prepare_backward_infra(self, n_microbatches):
        pass


MULTI = {"looped_bfs": "ScheduleLoopedBFS", "interleaved_1f1b": "ScheduleInterleaved1F1B",
         "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble"}


def _text(order) -> dict[int, list[str]]:
    return {r: ["" if a is None else str(a) for a in ops] for r, ops in order.items()}


def _torch_multi(name: str, n_local: int, m: int, pp: int):
    stages = [_Stage(n_local * pp, pp) for _ in range(n_local)]
    try:
        return _text(getattr(S, MULTI[name])(stages, m).pipeline_order)
    except ValueError as e:
        return e


@pytest.mark.parametrize("name", sorted(MULTI))
@pytest.mark.parametrize("plan", ["torch", "own"])
def test_multi_stage_orders_equal_torchs(name, plan):
    for n_local, m, pp in TORCH_PLAN if plan == "torch" else OWN_PLAN:
        want = _torch_multi(name, n_local, m, pp)
        if isinstance(want, ValueError):
            with pytest.raises(ValueError, match="multiple of the number of rounds"):
                orders.ORDERS[name](pp, n_local, m)
            continue
        got = _text(orders.ORDERS[name](pp, n_local, m))
        assert got == want, (name, n_local, m, pp)


@pytest.mark.parametrize("name,cls", [("gpipe", "ScheduleGPipe"),
                                      ("one_f_one_b", "Schedule1F1B")])
def test_single_stage_orders_equal_torchs(name, cls):
    for pp, m in itertools.product(range(1, 7), range(1, 11)):
        try:
            want = {r: [str(a) for a in ops if a is not None and a.microbatch_index is not None]
                    for r, ops in getattr(S, cls)(_Stage(pp, pp, 0), m).pipeline_order.items()}
        except ValueError:
            with pytest.raises(ValueError, match="greater than or equal to"):
                orders.ORDERS[name](pp, 1, m)
            continue
        if name == "one_f_one_b":  # torch's listing numbers the last rank's forwards
            # from 1 (it runs 0..m-1): a defect of the listing, not of the schedule
            want[pp - 1] = [_shift_forward(t) for t in want[pp - 1]]
        got = {r: [str(a) for a in compute_only(ops)]
               for r, ops in orders.ORDERS[name](pp, 1, m).items()}
        assert got == want, (name, pp, m)


def _shift_forward(text: str) -> str:
    a = parse(text)
    return str(a._replace(microbatch=a.microbatch - 1)) if a.kind is Kind.FORWARD else text


@pytest.mark.parametrize("text,want", [("1F0", Action(1, Kind.FORWARD, 0)),
                                       ("2I1", Action(2, Kind.BACKWARD_INPUT, 1)),
                                       ("0W3", Action(0, Kind.BACKWARD_WEIGHT, 3)),
                                       ("0B3", Action(0, Kind.BACKWARD, 3))])
def test_action_text_round_trips(text, want):
    assert parse(text) == want and str(want) == text


@pytest.mark.parametrize("bad", ["F0", "1X0", "1F", "-1F0"])
def test_bad_action_text_is_refused(bad):
    with pytest.raises(ValueError, match="not a schedule action"):
        parse(bad)


@pytest.mark.parametrize("name", sorted(orders.ORDERS))
def test_every_order_runs_each_computation_once_after_its_inputs(name):
    """Each stage's forward and backward (or I and W) of each micro-batch appear once, on
    the stage's rank, and some ordering of the ranks' lists respects every data
    dependency (what torch's _simulate_comms_compute checks)."""
    for pp, n_local, m in itertools.product((1, 2, 4), (1, 2), (4, 8)):
        if name in ("gpipe", "one_f_one_b") and n_local > 1:
            continue
        order = orders.ORDERS[name](pp, n_local, m)
        done: set = set()
        at = dict.fromkeys(order, 0)
        last = pp * n_local - 1
        while any(at[r] < len(order[r]) for r in order):
            moved = False
            for r, ops in order.items():
                while at[r] < len(ops):
                    a = ops[at[r]]
                    if a is not None:
                        assert a.stage % pp == r, (name, a, r)
                        if not _ready(a, done, last):
                            break
                        assert (a.stage, a.kind, a.microbatch) not in done, a
                        done.add((a.stage, a.kind, a.microbatch))
                    at[r] += 1
                    moved = True
            assert moved, (name, pp, n_local, m, "deadlock", at)
        kinds = ({Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT} if "zero" in name
                 else {Kind.BACKWARD})
        assert done == {(s, k, i) for s in range(last + 1) for i in range(m)
                        for k in kinds | {Kind.FORWARD}}


def _ready(a: Action, done: set, last: int) -> bool:
    if a.kind is Kind.FORWARD:
        return a.stage == 0 or (a.stage - 1, Kind.FORWARD, a.microbatch) in done
    if a.kind is Kind.BACKWARD_WEIGHT:
        return (a.stage, Kind.BACKWARD_INPUT, a.microbatch) in done
    if a.stage == last:
        return (a.stage, Kind.FORWARD, a.microbatch) in done
    return any((a.stage + 1, k, a.microbatch) in done
               for k in (Kind.BACKWARD, Kind.BACKWARD_INPUT))
