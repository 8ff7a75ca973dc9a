"""torch's test_join.py cases, run in one shared 2-process launch (tests/algorithms).

``AllReducer`` is torch's example joinable: each call all-reduces a 1 (``jdist.all_reduce``
on its process group) ``num_allreduces`` times; its hook shadows those all-reduces with
zeros, and its post-hook broadcasts ``AFTER_CONSTANT`` from the last joiner.
"""

from __future__ import annotations

import numpy as np

BEFORE_CONSTANT = 41
AFTER_CONSTANT = 42
BASE_NUM_INPUTS = 3
OFFSET = 1


def _classes():
    import jdist
    from jdist.algorithms.join import Join, Joinable, JoinHook

    class AllReducerJoinHook(JoinHook):
        def __init__(self, allreducer, num_allreduces, run_post_hook):
            self.allreducer = allreducer
            self.num_allreduces = num_allreduces
            self.run_post_hook = run_post_hook

        def main_hook(self):
            for _ in range(self.num_allreduces):
                jdist.all_reduce(np.zeros(1, np.float32), group=self.allreducer.process_group)

        def post_hook(self, is_last_joiner):
            if not self.run_post_hook:
                return
            pg = self.allreducer.process_group
            rank = jdist.get_rank(pg)
            common_rank = self.allreducer.find_common_rank(rank, is_last_joiner)
            if rank == common_rank:
                self.allreducer.post_hook_tensor = np.array([AFTER_CONSTANT], np.float32)
            jdist.broadcast(self.allreducer.post_hook_tensor, src=common_rank, group=pg)

    class AllReducer(Joinable):
        def __init__(self, device, process_group):
            super().__init__()
            self.device = device
            self.process_group = process_group
            self.post_hook_tensor = np.array([BEFORE_CONSTANT], np.float32)

        def __call__(self, num_allreduces=1):
            Join.notify_join_context(self)
            total = 0.0
            for _ in range(num_allreduces):
                t = jdist.all_reduce(np.ones(1, np.float32), group=self.process_group)
                total += float(t[0])
            return total

        def join_hook(self, **kwargs):
            return AllReducerJoinHook(self, kwargs.get("num_allreduces", 1),
                                      kwargs.get("run_post_hooks", False))

        @property
        def join_device(self):
            return self.device

        @property
        def join_process_group(self):
            return self.process_group

        def find_common_rank(self, rank, to_consider):
            common = jdist.all_reduce(np.array([rank if to_consider else -1], np.int32),
                                      op=jdist.ReduceOp.MAX, group=self.process_group)
            common = int(common[0])
            assert common >= 0
            return common

    return Join, AllReducer


def join_base(rank, world, *, uneven_inputs, num_joinables, enable,
              throw_on_early_termination, num_allreduces, run_post_hooks):
    """torch's ``_test_join_base``: returns what torch asserts on, for the test side."""
    Join, AllReducer = _classes()
    allreducers = [AllReducer(None, None) for _ in range(num_joinables)]
    before = [float(a.post_hook_tensor[0]) for a in allreducers]
    n = BASE_NUM_INPUTS + (rank * OFFSET if uneven_inputs else 0)
    total, error = 0.0, None
    try:
        with Join(allreducers, enable=enable,
                  throw_on_early_termination=throw_on_early_termination,
                  num_allreduces=num_allreduces, run_post_hooks=run_post_hooks):
            for _ in range(n):
                for a in allreducers:
                    total += a(num_allreduces)
    except RuntimeError as e:
        error = (type(e).__name__, str(e))
    return {"before": before, "total": total, "error": error,
            "after": [float(a.post_hook_tensor[0]) for a in allreducers]}


CASES = {
    "single_joinable_main_hooks": dict(uneven_inputs=True, num_joinables=1, enable=True,
                                       throw_on_early_termination=False, num_allreduces=1,
                                       run_post_hooks=False),
    "single_joinable_post_hooks": dict(uneven_inputs=True, num_joinables=1, enable=True,
                                       throw_on_early_termination=False, num_allreduces=0,
                                       run_post_hooks=False),
    "single_joinable": dict(uneven_inputs=True, num_joinables=1, enable=True,
                            throw_on_early_termination=False, num_allreduces=1,
                            run_post_hooks=True),
    "multiple_joinables": dict(uneven_inputs=True, num_joinables=3, enable=True,
                               throw_on_early_termination=False, num_allreduces=1,
                               run_post_hooks=True),
    "single_joinable_disable": dict(uneven_inputs=False, num_joinables=1, enable=False,
                                    throw_on_early_termination=False, num_allreduces=1,
                                    run_post_hooks=False),
    "multiple_joinable_disable": dict(uneven_inputs=False, num_joinables=3, enable=False,
                                      throw_on_early_termination=False, num_allreduces=1,
                                      run_post_hooks=False),
    "single_joinable_throw": dict(uneven_inputs=True, num_joinables=1, enable=True,
                                  throw_on_early_termination=True, num_allreduces=1,
                                  run_post_hooks=False),
    "multiple_joinables_throw": dict(uneven_inputs=True, num_joinables=3, enable=True,
                                     throw_on_early_termination=True, num_allreduces=1,
                                     run_post_hooks=False),
    "join_kwargs": dict(uneven_inputs=True, num_joinables=1, enable=True,
                        throw_on_early_termination=False, num_allreduces=2,
                        run_post_hooks=False),
}


def main():
    """The shared launch: every case in turn on every rank."""
    from tests.ddp.mp_cases import _finish, _init

    rank, world = _init()
    out = {"world": world}
    for name, kw in CASES.items():
        out[name] = join_base(rank, world, **kw)
    _finish()
    return out
