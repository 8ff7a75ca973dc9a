"""Checkpoint corruption: one generated bit flip or byte change in any file of the newest
step (arrays, JSON records, Orbax's and zarr's own metadata). The restore must equal
the uninterrupted run at that step (the change was harmless) or at the step before,
with a warning naming the changed part: never another state, never a crash.

The job is tests/checkpoint/train_job.py in-process (DDP over 8 devices with
SyncBatchNorm, Adam, a sampler, a numpy Generator, nnx.Rngs and a JSON log; without
its PowerSGD hook, whose restored state reaches the wrapper only at the next step).
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.checkpoint import CheckpointManager, _layout
from tests.checkpoint.train_job import build, digest, run
from tests.differential import replayed, scaled

BATCH = 16


def snapshot(state) -> dict:
    return copy.deepcopy({"digest": digest(state), "step": state["step"], "log": state["log"],
            "sampler": state["sampler"].state_dict(),
            "np_rng": state["np_rng"].bit_generator.state,
            "rngs": int(np.asarray(state["rngs"].noise.count[...]))})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 2 and 4 on disk, and the uninterrupted run's state at each."""
    d = tmp_path_factory.mktemp("ck")
    m = CheckpointManager(d, save_interval_steps=2, async_save=False)
    state = m.restore_or_init(lambda: build(0, 1, hook=False))
    snaps = {2: snapshot(run(m, state, 2, BATCH))}
    snaps[4] = snapshot(run(m, state, 4, BATCH))
    m.close()
    step4 = _layout.step_dir(str(d), 4)
    files = sorted(os.path.relpath(os.path.join(root, f), step4)
                   for root, _, fs in os.walk(step4) for f in fs)
    return {"dir": str(d), "snaps": snaps, "files": files}


corruptions = st.fixed_dictionaries({
    "file_frac": st.floats(0, 1, exclude_max=True),
    "pos_frac": st.floats(0, 1, exclude_max=True),
    "how": st.sampled_from(["bit", "byte"]),
    "bit": st.integers(0, 7),
    "byte": st.integers(0, 255),
})


def corrupt(path: str, c: dict) -> bool:
    """Change one byte of ``path``; False when the file is empty or nothing changed."""
    data = bytearray(open(path, "rb").read())
    if not data:
        return False
    i = int(c["pos_frac"] * len(data))
    old = data[i]
    data[i] = old ^ (1 << c["bit"]) if c["how"] == "bit" else c["byte"]
    if data[i] == old:
        return False
    with open(path, "wb") as f:
        f.write(data)
    return True


@given(case=corruptions)
@settings(max_examples=scaled(25))
@replayed("checkpoint_corruption")
def test_one_changed_byte_restores_exactly_or_falls_back_with_a_warning(case, saved,
                                                                       tmp_path_factory):
    d = str(tmp_path_factory.mktemp("copy"))
    shutil.rmtree(d)
    shutil.copytree(saved["dir"], d)
    rel = saved["files"][int(case["file_frac"] * len(saved["files"]))]
    changed = corrupt(os.path.join(_layout.step_dir(d, 4), rel), case)
    m = CheckpointManager(d)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = m.restore_or_init(lambda: build(0, 1, hook=False))
    m.close()
    step = m.restored_step
    said = [str(w.message) for w in caught if "skipping checkpoint step 4" in str(w.message)]
    assert step in (2, 4), (rel, case, step)
    if step == 2:
        assert changed and said, (rel, case, [str(w.message) for w in caught])
    assert snapshot(state) == saved["snaps"][step], (rel, case, step)
