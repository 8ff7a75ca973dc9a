"""The stuck-rank deadline (``jdist/collectives/_stuck.py``): when a collective or a
compiled step waits longer than ``stuck_timeout`` for a rank that never entered it,
every rank exits with one message naming that rank, where it is and its stack.

The decision is checked on a grid of positions and waits against a rule written out
here, on a real heartbeat (``Watchdog``) over an in-memory store; then 3 real processes:
after 20 normal steps with ranks late by a quarter of the deadline (none may exit), a
rank sleeping in Python (every rank, itself included, exits with the same message) and
a rank stopped with SIGSTOP inside a DDP step loop (the others exit naming it as
stopped; the launcher ends it), both well before the group timeout."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import pytest

from jdist.collectives._stuck import STUCK_EXIT_CODE, StuckDeadline, stuck_timeout_from
from jdist.collectives._watchdog import Watchdog
from jdist.launch import SpawnError, spawn
from jdist.store import HashStore

# -- the setting --------------------------------------------------------------------


@pytest.mark.parametrize("value,env,want", [
    (None, {}, None), (None, {"JDIST_STUCK_TIMEOUT": ""}, None),
    (None, {"JDIST_STUCK_TIMEOUT": "2.5"}, 2.5), (7, {"JDIST_STUCK_TIMEOUT": "2.5"}, 7.0),
    ("0.25", {}, 0.25)])
def test_the_deadline_comes_from_the_argument_then_the_environment(value, env, want):
    assert stuck_timeout_from(value, env) == want


@pytest.mark.parametrize("value,env", [
    (0, {}), (-1, {}), ("soon", {}), (float("inf"), {}), (float("nan"), {}),
    (None, {"JDIST_STUCK_TIMEOUT": "-3"}), (None, {"JDIST_STUCK_TIMEOUT": "x"})])
def test_a_bad_deadline_is_refused_naming_it(value, env):
    with pytest.raises(ValueError, match="positive number of seconds") as info:
        stuck_timeout_from(value, env)
    assert repr(value if value is not None else env["JDIST_STUCK_TIMEOUT"]) in str(info.value)


# -- the decision, on a real heartbeat over an in-memory store ---------------------------

MINE = 5
POSITIONS = (None, MINE - 1, MINE, MINE + 1)  # another rank: none, behind, level, ahead


BEAT = 0.05  # the heartbeat interval of these in-process watchdogs (never started)


def _watchdogs(store, n=3, seconds=0.2):
    exits = {r: [] for r in range(n)}
    infos = [{"host": "elsewhere", "pid": 1}] * n  # (no local process to inspect)
    wds = []
    for r in range(n):
        wd = Watchdog(store, r, infos, generation=1, interval=BEAT, store_host_rank=None,
                      stuck_timeout=seconds)
        wd.deadline = StuckDeadline(wd, seconds, exit=exits[r].append, linger=0.0)
        wd.stacks = True
        wds.append(wd)
    return wds, exits


@pytest.mark.parametrize("pos1,pos2,waited", [
    (a, b, w) for a, b in itertools.product(POSITIONS, POSITIONS) for w in (False, True)])
def test_a_rank_exits_iff_it_waited_past_the_deadline_for_a_rank_behind(pos1, pos2, waited,
                                                                       capsys):
    store = HashStore()
    wds, exits = _watchdogs(store)
    for r, pos in ((1, pos1), (2, pos2)):
        if pos is not None:
            wds[r].note("g", pos, f"all_reduce #{pos}", (0, 1, 2))
            wds[r]._beat()
    wds[0].note("g", MINE, "all_reduce", (0, 1, 2))
    wds[0]._beat()
    if waited:
        time.sleep(0.25)
    wds[0].deadline.check()  # (a first sighting is never enough: positions may be old)
    assert exits[0] == []
    for r, pos in ((1, pos1), (2, pos2)):  # ranks that beat publish afresh; the others
        if pos is not None:  # stay silent for three beats
            wds[r]._beat()
            wds[r]._beat()
    time.sleep(3 * BEAT + 0.02)
    wds[0].deadline.check()
    late = [r for r, pos in ((1, pos1), (2, pos2)) if pos is None or pos < MINE]
    should = waited and bool(late)  # the rule, written out
    assert exits[0] == ([STUCK_EXIT_CODE] if should else [])
    err = capsys.readouterr().err
    for r in (1, 2):
        named = (f"rank {r}, which is still at" in err
                 or f"rank {r}, which has not entered" in err)
        assert named == (should and r in late), err
    if should:  # the others read the same message at their next beat, and exit too
        wds[1].deadline.check()
        assert exits[1] == [STUCK_EXIT_CODE]
        assert capsys.readouterr().err == err


def test_a_rank_that_arrives_after_the_first_sighting_ends_nothing(capsys):
    """A position read at the deadline may be a beat old: the rank it shows behind
    entered the call meanwhile, and its next beats say so."""
    wds, exits = _watchdogs(HashStore())
    for r in (1, 2):
        wds[r].note("g", MINE - 1, "all_reduce", (0, 1, 2))
        wds[r]._beat()
    wds[0].note("g", MINE, "all_reduce", (0, 1, 2))
    time.sleep(0.25)
    wds[0].deadline.check()
    for r in (1, 2):  # they arrive, and beat
        wds[r].note("g", MINE, "all_reduce", (0, 1, 2))
        wds[r]._beat()
        wds[r]._beat()
    time.sleep(3 * BEAT + 0.02)
    wds[0].deadline.check()
    assert exits[0] == [] and "stuck rank" not in capsys.readouterr().err


def test_behind_lists_ranks_before_the_number_or_without_one():
    """The deadline's notion of behind is the heartbeat's (``Watchdog.behind``)."""
    wds, _ = _watchdogs(HashStore(), n=5)
    for r, pos in ((2, 4), (3, 5), (4, 9)):  # (rank 1 never published)
        wds[r].note("g", pos, "x", range(5))
        wds[r]._beat()
    assert sorted(wds[0].behind(range(5), "g", 5)) == [1, 2]


# -- real processes ------------------------------------------------------------------

DEADLINE = 1.5
STUCK = 2


def _job(path: str, out: str) -> None:
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel

    # all of this rank's stderr in a file (the launcher keeps a tail of 25 lines)
    os.dup2(os.open(os.path.join(out, f"rank{os.environ['RANK']}.err"),
                    os.O_WRONLY | os.O_CREAT, 0o600), 2)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (let every rank exit by itself)
    jdist.init_process_group(timeout=60, stuck_timeout=DEADLINE)
    rank = jdist.get_rank()
    if path == "eager":
        def step():
            return jdist.all_reduce(np.ones(3, np.float32))
    else:
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        train = DistributedDataParallel(model).train_step(
            lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), opt)
        batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros((4, 2), np.float32)}

        def step():
            return np.asarray(train(batch))
    for i in range(20):  # normal steps, a rank now and then late by a fraction of the
        if i % 10 == rank:  # deadline: no rank may exit here (no false positive)
            time.sleep(DEADLINE / 4)
        step()
    print("normal steps done", file=sys.stderr, flush=True)
    if rank == STUCK:
        time.sleep(1.0)  # (its heartbeat publishes this line's stack)
        if path == "ddp-stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(30)
    step()  # the others wait here for the stuck rank
    raise AssertionError("the step after the stuck rank's sleep returned")


@pytest.mark.parametrize("path", ["eager", "ddp-stopped"])
def test_every_rank_exits_naming_the_stuck_rank_before_the_group_timeout(path, tmp_path):
    t = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_job, args=(path, str(tmp_path)), nprocs=3, timeout=120, grace=4.0,
              start_method="forkserver", env={"JDIST_HEARTBEAT_INTERVAL": "0.25"})
    took = time.monotonic() - t
    codes = info.value.exitcodes
    errs = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(3)}
    noun = "collective" if path == "eager" else "step"
    for rank in (0, 1, 2):
        assert "normal steps done" in errs[rank], (rank, errs[rank][-2000:])
    for rank in (0, 1):
        assert codes[rank] == STUCK_EXIT_CODE, (rank, codes, errs[rank][-2000:])
        err = errs[rank]
        assert f"for rank {STUCK}, which is still at {noun} #" in err, err[-2000:]
        assert "stuck-rank deadline, JDIST_STUCK_TIMEOUT=1.5" in err
        # (the stack of the call after the normal steps, where rank 2 stalls)
        where = ("time.sleep(30)",) if path == "eager" else ("time.sleep(1.0)", "os.kill(")
        assert any(w in err for w in where), err[-2000:]
        assert "Traceback" not in err, err[-3000:]  # (no error over the message)
        assert ("its process is stopped" in err) == (path == "ddp-stopped"), err[-2000:]
    if path == "eager":  # its heartbeat still runs: it exits itself, with the message
        assert codes[STUCK] == STUCK_EXIT_CODE, (codes, errs[STUCK][-2000:])
        assert f"for rank {STUCK}, which is still at" in errs[STUCK]
    else:  # stopped: the launcher ends it
        assert codes[STUCK] == -signal.SIGKILL, codes
    assert took < 40, took  # (the group timeout is 60 s)
