"""Generated kill schedules for a DDP job with checkpoints under ``jdist-run``.

A schedule is up to three interruptions, one per attempt, each of a rank drawn at
random, at a step drawn at random: SIGKILL between saves, SIGKILL while a save is
being written, or SIGTERM with ``save_on_preemption`` (every rank saves the next step
and exits 143). The job (``tests/checkpoint/train_job.py``: 2 processes x 2 devices,
SyncBatchNorm, Adam, PowerSGD, a sampler, Generators) restarts after each; its last
attempt then trains again from scratch, uninterrupted, in the same processes: the
oracle. Parameters, buffers, optimizer and hook state must be bit-identical to it, and
every epoch must consume the same indices in the same order (epoch 0: each sample
exactly once across the ranks).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from tests.checkpoint.test_kill_resume import _launch, _outputs
from tests.checkpoint.train_job import N_SAMPLES
from tests.differential import replayed, scaled

STEPS, INTERVAL = 12, 2


@st.composite
def schedules(draw):
    kills, after = [], 0  # ``after``: the first step a next interruption may take
    for attempt in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["kill", "save", "term"]))
        steps = [s for s in range(after + 1, STEPS - 1)
                 if how != "save" or s % INTERVAL == 0]
        if not steps:
            break
        step = draw(st.sampled_from(steps))
        rank = draw(st.integers(0, 1))
        kills.append({"attempt": attempt, "rank": rank, "step": step, "how": how})
        after = step + 1 if how == "term" else step  # term: the save comes a step later
    return {"kills": kills}


# every kind in one schedule: the CI slice (a launch costs ~20 s of the suite's 2
# cores); the long profile generates schedules
THREE = {"kills": [{"attempt": 0, "rank": 1, "step": 3, "how": "term"},
                   {"attempt": 1, "rank": 0, "step": 6, "how": "save"},
                   {"attempt": 2, "rank": 1, "step": 9, "how": "kill"}]}
_CI = settings.default.derandomize  # the "ci" profile (tests/conftest.py)


@settings(max_examples=scaled(1), deadline=None,
          phases=(Phase.explicit,) if _CI else tuple(Phase))
@pytest.mark.slow(seconds=32)  # kills and resumes
@given(case=schedules())
@example(case=THREE)
@replayed("checkpoint_kills")
def test_interrupted_training_resumes_bit_identical(case, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kills")
    out = tmp / "out"
    out.mkdir()
    args = ["--dir", str(tmp / "ck"), "--out", str(out), "--steps", str(STEPS),
            "--interval", str(INTERVAL), "--keep", "2", "--reference", str(tmp / "ref"),
            "--preemption"]
    for k in case["kills"]:
        suffix = {"kill": "", "save": ":save", "term": ":term"}[k["how"]]
        args += ["--kill", f"{k['attempt']}:{k['rank']}:{k['step']}{suffix}"]
    n = len(case["kills"])
    res = _launch(["--nproc-per-node", "2", "--devices-per-proc", "2",
                   "--max-restarts", str(n)], args)
    assert res.returncode == 0, res.stderr[-6000:]
    for i in range(n):
        assert f"restarting the job (attempt {i + 2} of {n + 1})" in res.stderr, (case, i)
    terms = sum(k["how"] == "term" for k in case["kills"])
    assert res.stderr.count("exited with code 143; restarting") == terms, case
    ranks = _outputs(out, 2)
    for r in ranks:
        assert r["attempt"] == n
        ref = r["reference"]
        assert (r["model"], r["optimizer"], r["hook"]) == (
            ref["model"], ref["optimizer"], ref["hook"]), (case, r["rank"])
        assert r["log"] == ref["log"]
    both = ranks[0]["log"]["0"] + ranks[1]["log"]["0"]
    assert sorted(both) == list(range(N_SAMPLES))
