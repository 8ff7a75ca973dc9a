"""Stages in separate processes (``jdist/pipelining/_remote.py``; messages over
``_sockets.py``, the mailbox, and ``_links.py``, XLA's point-to-point): 2 and 4 real
processes, every schedule, both transports; per step the last rank's merged output and
losses, and every rank's stage gradients, equal a single-process run of the same model
(1e-6) over steps with an optax update between them. A stage that raises makes every
rank raise, naming the rank, stage and action, instead of hanging (each failure case
runs on both transports in one launch)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_procs

D, BATCH, M = 6, 12, 4
TRANSPORTS = ("socket", "xla")
EVERY = [("GPipe", 1), ("1F1B", 1), ("LoopedBFS", 2), ("Interleaved1F1B", 2),
         ("InterleavedZeroBubble", 2)]  # (name, stages per rank)
# (name, stages, transport): every schedule on both transports on 2 processes; on 4,
# every schedule on the mailbox and two on XLA's point-to-point
SCHEDULES_2 = [(n, 2 * k, t) for t in TRANSPORTS for n, k in EVERY]
SCHEDULES_4 = [(n, 4 * k, "socket") for n, k in EVERY] + [
    ("1F1B", 4, "xla"), ("InterleavedZeroBubble", 8, "xla")]


def _model(n_stages):
    import jax.numpy as jnp
    from flax import nnx

    rngs = nnx.Rngs(0)
    return [nnx.Sequential(nnx.Linear(D, D, rngs=rngs), jnp.tanh) for _ in range(n_stages)]


def _mse(out, target):
    import jax.numpy as jnp
    return jnp.mean((out - target) ** 2)


def _data(step):
    rng = np.random.default_rng(step)
    return (rng.standard_normal((BATCH, D)).astype(np.float32),
            rng.standard_normal((BATCH, D)).astype(np.float32))


def _train(name, n_stages, mine, steps=2, transport="auto"):
    """Train ``mine`` (the stage indices here); with every stage here, single-process."""
    import jax
    import optax
    from flax import nnx

    import jdist.pipelining as pp

    mods = _model(n_stages)
    stages = [pp.PipelineStage(mods[i], i, n_stages) for i in mine]
    opts = {i: nnx.Optimizer(mods[i], optax.sgd(0.1), wrt=nnx.Param) for i in mine}
    sched = pp.get_schedule_class(name)(stages, M, loss_fn=_mse, transport=transport)
    record = []
    for step in range(steps):
        x, y = _data(step)
        losses = []
        args = (x,) if 0 in mine else ()
        target = y if n_stages - 1 in mine else None
        out = sched.step(*args, target=target, losses=losses)
        grads = {st.stage_index: jax.tree.map(np.asarray, nnx.to_pure_dict(st.grads))
                 for st in stages}
        record.append({"out": None if out is None else np.asarray(out),
                       "losses": [float(v) for v in losses], "grads": grads})
        for st in stages:
            opts[st.stage_index].update(mods[st.stage_index], st.grads)
    return record


def _outcome(step) -> tuple[str, float]:
    """``("none" or "<ErrorClass>: message", seconds)`` of calling ``step()``."""
    import time

    t = time.monotonic()
    try:
        step()
        err = "none"
    except Exception as exc:
        err = f"{type(exc).__name__}: {exc}"
    return err, time.monotonic() - t


def _child(cases):
    import jdist

    jdist.init_process_group(timeout=60)
    rank, world = jdist.get_rank(), jdist.get_world_size()
    out = {}
    for name, n_stages, transport in cases:
        out[name, transport] = _train(name, n_stages, list(range(rank, n_stages, world)),
                                      transport=transport)
    jdist.destroy_process_group()
    return out


def _check(results, cases, world):
    refs = {}
    for name, n_stages, transport in cases:
        if (name, n_stages) not in refs:
            refs[name, n_stages] = _train(name, n_stages, list(range(n_stages)))
        for step, want in enumerate(refs[name, n_stages]):
            last = results[(n_stages - 1) % world][name, transport][step]
            np.testing.assert_allclose(last["out"], want["out"], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(last["losses"], want["losses"], rtol=1e-6, atol=1e-7)
            for r in range(world):
                got = results[r][name, transport][step]
                if r != (n_stages - 1) % world:
                    assert got["out"] is None and got["losses"] == []
                for s, g in got["grads"].items():
                    assert s % world == r
                    import jax
                    jax.tree.map(lambda a, b: np.testing.assert_allclose(
                        a, b, rtol=1e-5, atol=1e-6), g, want["grads"][s])


@pytest.mark.slow(seconds=12)  # every schedule, both transports
def test_two_processes_every_schedule_equals_one_process():
    results = run_procs(_child, 2, args=(SCHEDULES_2,), timeout=300)
    _check(results, SCHEDULES_2, 2)


@pytest.mark.slow(seconds=15)  # every schedule on 4 processes
def test_four_processes_equal_one_process():
    results = run_procs(_child, 4, args=(SCHEDULES_4,), timeout=300)
    _check(results, SCHEDULES_4, 4)


def _failing(bad_rank):

    import jax.numpy as jnp

    import jdist
    import jdist.pipelining as pp

    jdist.init_process_group(timeout=30)
    rank = jdist.get_rank()
    mods = _model(4)

    def loss(out, target):
        if rank == bad_rank:
            raise FloatingPointError("the loss blew up")
        return jnp.mean((out - target) ** 2)

    stages = [pp.PipelineStage(mods[i], i, 4) for i in (rank, rank + 2)]
    x, y = _data(0)
    out = []
    for transport in TRANSPORTS:
        sched = pp.ScheduleInterleaved1F1B(stages, 4, loss_fn=loss, transport=transport)
        out.append(_outcome(lambda s=sched: s.step(*((x,) if rank == 0 else ()),
                                                   target=y if rank == 1 else None)))
    jdist.destroy_process_group()
    return out


def test_a_failing_stage_makes_every_rank_raise():
    out0, out1 = run_procs(_failing, 2, args=(1,), timeout=120)
    for (err0, t0), (err1, t1) in zip(out0, out1, strict=True):
        assert err1.startswith("FloatingPointError") and "pipeline rank 1, stage 3" in err1, \
            err1
        assert err0.startswith("PeerFailedError") and "rank 1" in err0, err0
        assert "the loss blew up" in err0
        assert t0 < 20 and t1 < 20


def _dp_pp(name, n_stages):
    """4 processes: 2 pipeline replicas (ranks 0-1 and 2-3) of 2 pipeline ranks each,
    each replica on its half of the batch; stage gradients averaged over replicas."""
    import jax
    import optax
    from flax import nnx

    import jdist
    import jdist.pipelining as pp

    jdist.init_process_group(timeout=60)
    rank = jdist.get_rank()
    pp_groups = [jdist.new_group([0, 1]), jdist.new_group([2, 3])]
    dp_groups = [jdist.new_group([0, 2]), jdist.new_group([1, 3])]
    replica, pp_rank = divmod(rank, 2)
    mods = _model(n_stages)
    mine = list(range(pp_rank, n_stages, 2))
    stages = [pp.PipelineStage(mods[i], i, n_stages) for i in mine]
    opts = {i: nnx.Optimizer(mods[i], optax.sgd(0.1), wrt=nnx.Param) for i in mine}
    sched = pp.get_schedule_class(name)(stages, 2, loss_fn=_mse, group=pp_groups[replica],
                                        dp_group=dp_groups[pp_rank])
    record = []
    half = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
    for step in range(2):
        x, y = _data(step)
        losses = []
        sched.step(*((x[half],) if 0 in mine else ()),
                   target=y[half] if n_stages - 1 in mine else None, losses=losses)
        record.append({st.stage_index: jax.tree.map(np.asarray, nnx.to_pure_dict(st.grads))
                       for st in stages})
        for st in stages:
            opts[st.stage_index].update(mods[st.stage_index], st.grads)
    jdist.destroy_process_group()
    return record


def test_pipeline_replicas_average_like_one_process_on_the_whole_batch():
    import jax

    name, n_stages = "Interleaved1F1B", 4
    results = run_procs(_dp_pp, 4, args=(name, n_stages), timeout=300)
    ref = _train(name, n_stages, list(range(n_stages)))  # whole batch, 4 micro-batches
    for rank, record in enumerate(results):
        for step, grads in enumerate(record):
            for s, g in grads.items():
                assert s % 2 == rank % 2
                jax.tree.map(lambda a, b: np.testing.assert_allclose(
                    a, b, rtol=1e-5, atol=1e-6), g, ref[step]["grads"][s])


def _forgot_target():

    import jdist
    import jdist.pipelining as pp

    jdist.init_process_group(timeout=30)
    rank = jdist.get_rank()
    mods = _model(2)
    x, _ = _data(0)
    out = []
    for transport in TRANSPORTS:
        sched = pp.Schedule1F1B(pp.PipelineStage(mods[rank], rank, 2), 2, loss_fn=_mse,
                                transport=transport)
        out.append(_outcome(lambda s=sched: s.step(*((x,) if rank == 0 else ()))))
    jdist.destroy_process_group()
    return out


def test_bad_step_arguments_on_one_rank_make_every_rank_raise():
    out0, out1 = run_procs(_forgot_target, 2, timeout=120)
    for (err0, t0), (err1, t1) in zip(out0, out1, strict=True):
        assert err1.startswith("ValueError") and "passes the target" in err1, err1
        assert err0.startswith("PeerFailedError") and "passes the target" in err0, err0
        assert t0 < 20 and t1 < 20


def _changing(mode, rows, fail_at):
    """1F1B over 2 processes with the batch size changing between steps, then a stage
    failing on a later step; with the mismatch check on and off (``JDIST_DEBUG``); on
    the mailbox, then on XLA's point-to-point."""
    import os

    import jax.numpy as jnp

    os.environ["JDIST_DEBUG"] = mode
    import jdist
    import jdist.pipelining as pp

    jdist.init_process_group(timeout=30)
    rank = jdist.get_rank()
    mods = _model(2)
    state = {"step": 0}

    def loss(out, target):
        if rank == 1 and state["step"] == fail_at:
            raise FloatingPointError("late failure")
        return jnp.mean((out - target) ** 2)

    result = []
    for transport in TRANSPORTS:
        sched = pp.Schedule1F1B(pp.PipelineStage(mods[rank], rank, 2), 2, loss_fn=loss,
                                transport=transport)
        outs, err = [], "none"
        for step, n in enumerate(rows):
            state["step"] = step
            x, y = _data(step)
            try:
                out = sched.step(*((x[:n],) if rank == 0 else ()),
                                 target=y[:n] if rank == 1 else None)
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"
                break
            outs.append(None if out is None else np.asarray(out))
        result.append((outs, err))
    jdist.destroy_process_group()
    return result


def test_changing_shapes_and_late_failures_with_and_without_headers():
    import jax.numpy as jnp

    import jdist.pipelining as pp

    rows = [12, 12, 8, 8, 10]  # (the loss raises when traced: step 4's new shape)
    mods = _model(2)
    ref = pp.Schedule1F1B([pp.PipelineStage(m, i, 2) for i, m in enumerate(mods)], 2,
                          loss_fn=lambda o, t: jnp.mean((o - t) ** 2))
    want = [np.asarray(ref.step(_data(s)[0][:n], target=_data(s)[1][:n]))
            for s, n in enumerate(rows)]
    for mode in ("ON", "OFF"):
        res0, res1 = run_procs(_changing, 2, args=(mode, rows, 4), timeout=120)
        for (outs0, err0), (outs1, err1) in zip(res0, res1, strict=True):
            assert len(outs1) == 4 and outs0 == [None] * 4, (mode, err1)
            for got, w in zip(outs1, want, strict=False):
                np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)
            assert err1.startswith("FloatingPointError") and "late failure" in err1, err1
            assert err0.startswith("PeerFailedError") and "late failure" in err0, (mode, err0)


def _tuple_between_processes():
    import jax.numpy as jnp
    from flax import nnx

    import jdist
    import jdist.pipelining as pp

    class Pair(nnx.Module):  # returns two arrays
        def __init__(self):
            self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.lin(x), x

    class Sum(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(1))

        def __call__(self, a, b):
            return self.lin(a + b)

    jdist.init_process_group(timeout=30)
    rank = jdist.get_rank()
    stage = pp.PipelineStage(Pair() if rank == 0 else Sum(), rank, 2)
    x, y = _data(0)
    errs = []
    for transport in TRANSPORTS:
        sched = pp.ScheduleGPipe(stage, 2, loss_fn=lambda o, t: jnp.mean((o - t) ** 2),
                                 transport=transport)
        errs.append(_outcome(lambda s=sched: s.step(*((x,) if rank == 0 else ()),
                                                    target=y if rank == 1 else None))[0])
    jdist.destroy_process_group()
    return errs


def test_a_stage_returning_several_arrays_across_processes_is_refused_everywhere():
    errs0, errs1 = run_procs(_tuple_between_processes, 2, timeout=120)
    for err0, err1 in zip(errs0, errs1, strict=True):
        assert err0.startswith("ValueError") and "pass one array" in err0, err0
        assert err1.startswith("PeerFailedError") and "pass one array" in err1, err1


def _peer_dies(transport, when):
    """Rank 1 (the last stage) dies before its first step (``when="before"``: it never
    published its mailbox's address) or inside it, before it sends anything back (its
    loss function exits); rank 0 reports what its step raised and how long it took (it
    ignores the launcher's SIGTERM for that)."""
    import os
    import signal
    import sys

    import jdist
    import jdist.pipelining as pp

    def dying_loss(out, target):
        os._exit(3)

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    jdist.init_process_group(timeout=60)
    rank = jdist.get_rank()
    mods = _model(2)
    sched = pp.ScheduleGPipe(pp.PipelineStage(mods[rank], rank, 2), 2, loss_fn=dying_loss,
                             transport=transport)
    x, y = _data(0)
    if rank == 1:
        if when == "before":
            os._exit(3)
        sched.step(target=y)
    err, took = _outcome(lambda: sched.step(x))
    print(f"OUTCOME {took:.1f} s {err}", file=sys.stderr, flush=True)
    os._exit(0)


@pytest.mark.parametrize("transport,when", [("socket", "before"), ("socket", "during"),
                                            ("xla", "during")])
def test_a_dead_peer_is_named_within_seconds_not_at_the_timeout(transport, when):
    from jdist.launch import SpawnError, spawn

    with pytest.raises(SpawnError) as info:
        spawn(_peer_dies, args=(transport, when), nprocs=2, timeout=120, grace=20.0,
              start_method="forkserver")
    line = next((ln for ln in info.value.stderr[0].splitlines() if "OUTCOME" in ln), "")
    assert "PeerFailedError" in line and "rank 1" in line, info.value.stderr[0][-2000:]
    assert float(line.split("OUTCOME")[1].split()[0]) < 15, line


def _late_failure_and_bad_split():
    """On each transport: (1) 1F1B over 2 ranks where rank 0's last backward raises
    after rank 1 has sent its last message (rank 1 has nothing left to receive);
    (2) rank 0's batch too small to split, a check made before the step's messages;
    (3) then a good step, which must still pair the ranks' messages."""
    import jdist
    import jdist.pipelining as pp

    jdist.init_process_group(timeout=30)
    rank = jdist.get_rank()
    mods = _model(2)
    x, y = _data(0)
    out = {}
    for transport in TRANSPORTS:
        stage = pp.PipelineStage(mods[rank], rank, 2)
        if rank == 0:
            real = stage.backward

            def backward(mb, grad_output=None, real=real):
                if mb == M - 1:
                    raise FloatingPointError("the last backward blew up")
                return real(mb, grad_output)

            stage.backward = backward
        sched = pp.Schedule1F1B(stage, M, loss_fn=_mse, transport=transport)
        got = [_outcome(lambda s=sched: s.step(*((x,) if rank == 0 else ()),
                                               target=y if rank == 1 else None))[0]]
        got.append(_outcome(lambda s=sched: s.step(*((x[:2],) if rank == 0 else ()),
                                                   target=y if rank == 1 else None))[0])
        if rank == 0:
            stage.backward = real
        got.append(_outcome(lambda s=sched: s.step(*((x,) if rank == 0 else ()),
                                                   target=y if rank == 1 else None))[0])
        out[transport] = got
    jdist.destroy_process_group()
    return out


def test_no_rank_returns_from_a_step_that_failed_elsewhere():
    res0, res1 = run_procs(_late_failure_and_bad_split, 2, timeout=120)
    for transport in TRANSPORTS:
        (late0, split0, good0), (late1, split1, good1) = res0[transport], res1[transport]
        assert late0.startswith("FloatingPointError"), (transport, late0)
        assert late1.startswith("PeerFailedError") and "blew up" in late1, (transport, late1)
        assert split0.startswith("ValueError") and "cannot be split" in split0, split0
        assert split1.startswith("PeerFailedError") and "cannot be split" in split1, split1
        assert good0 == good1 == "none", (transport, good0, good1)
