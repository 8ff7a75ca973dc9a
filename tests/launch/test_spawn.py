"""jdist.launch.spawn runs real processes and reports failures."""

import os

import pytest

from jdist.launch import SpawnError
from tests.helpers import run_procs


def _env_of_rank():
    import jax

    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), len(jax.devices()))


def _fail_on_rank1():
    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")
    import time

    time.sleep(30)
    return "unreachable"


def test_spawn_returns_results_per_rank():
    assert run_procs(_env_of_rank, 3, devices_per_proc=2, timeout=60) == [
        (0, 3, 2), (1, 3, 2), (2, 3, 2)]


def test_spawn_failure_names_rank_and_ends_the_others():
    with pytest.raises(SpawnError, match="rank 1 exited with 1") as info:
        run_procs(_fail_on_rank1, 2, timeout=60)
    assert "boom on purpose" in str(info.value)
