"""init_process_group's view of the detected job (pure: no processes, no JAX runtime).

``parse_init`` turns the environment into the rendezvous spec, ``describe`` into what
``describe_job()`` reports, and ``local_device_ids`` into the devices a process drives.
"""

from __future__ import annotations

import pytest

from jdist.collectives import _rendezvous as rdzv
from jdist.launch._cluster import JobSpec, derived_port, detect_job, local_device_ids

SLURM = {"SLURM_JOB_ID": "777", "SLURM_STEP_ID": "2", "SLURM_PROCID": "1",
         "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
         "SLURM_STEP_NODELIST": "gpu[10-11]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def test_no_arguments_use_the_detected_job():
    spec = rdzv.parse_init(None, -1, -1, None, env=SLURM)
    assert spec == rdzv.InitSpec("env", 1, 4, "gpu10", derived_port("777", 2, 0))
    job = rdzv.describe(None, -1, -1, None, spec, env=SLURM)
    assert job.source == "slurm" and "SLURM_PROCID=1" in job.reason
    assert "source: slurm" in str(job) and "gpu10" in str(job)


def test_explicit_arguments_come_first():
    env = {**SLURM, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "4000"}
    spec = rdzv.parse_init("env://", 4, 3, None, env=env)  # both given: env gives the address
    assert spec == rdzv.InitSpec("env", 3, 4, "10.0.0.9", 4000)
    assert rdzv.describe("env://", 4, 3, None, spec, env=env).source == "explicit"
    spec = rdzv.parse_init(None, -1, 2, None, env=SLURM)  # rank given, the rest detected
    assert (spec.rank, spec.world_size, spec.host) == (2, 4, "gpu10")
    job = rdzv.describe(None, -1, 2, None, spec, env=SLURM)
    assert job.source == "slurm" and job.rank == 2 and "overridden" in job.reason
    spec = rdzv.parse_init("tcp://h:5?rank=0&world_size=2", -1, -1, None, env=SLURM)
    job = rdzv.describe("tcp://h:5?rank=0&world_size=2", -1, -1, None, spec, env=SLURM)
    assert (job.source, job.master_addr, job.master_port) == ("explicit", "h", 5)
    # a torchrun pair completed by an argument
    env = {"RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "9"}
    assert rdzv.parse_init(None, 2, -1, None, env=env) == rdzv.InitSpec("env", 1, 2, "a", 9)


def test_malformed_scheduler_variables_reach_init_process_group():
    with pytest.raises(ValueError, match=r"SLURM_PROCID=4 must be below SLURM_NTASKS=4"):
        rdzv.parse_init(None, -1, -1, None, env={**SLURM, "SLURM_PROCID": "4"})
    with pytest.raises(ValueError, match=r"environment variable WORLD_SIZE expected"):
        rdzv.parse_init(None, -1, -1, None, env={"RANK": "0"})


def _job(source="slurm", local_rank=1):
    return JobSpec(source, local_rank, 4, local_rank, 2, 0, 2, "h", 1, "j", 0, "test")


def test_devices_per_process_is_a_choice():
    assert local_device_ids(None, _job(), {})[0] is None  # default: all it sees
    assert local_device_ids("all", _job(), {})[0] is None
    assert local_device_ids("one", _job(), {})[0] == (1,)  # the local rank's device
    assert local_device_ids(2, _job(), {})[0] == (2, 3)
    assert local_device_ids([5, 7], _job(), {})[0] == (5, 7)
    assert local_device_ids(None, _job(), {"JDIST_LOCAL_DEVICES": "0,2"})[0] == (0, 2)
    ids, why = local_device_ids(None, _job(), {"SLURM_GPUS_PER_TASK": "1"})
    assert ids == (1,) and "SLURM_GPUS_PER_TASK" in why  # --gpus-per-task implies one
    ids, why = local_device_ids(None, _job(), {"SLURM_GPUS_PER_TASK": "1",
                                               "CUDA_VISIBLE_DEVICES": "3"})
    assert ids is None and "exactly those visible" in why  # SLURM already bound it
    assert local_device_ids(None, _job("openmpi"), {"SLURM_GPUS_PER_TASK": "1"})[0] is None
    for bad, message in [("two", "local_devices='two' is not 'all', 'one'"),
                         (0, "must be >= 1"), ([], "at least one device id")]:
        with pytest.raises(ValueError, match=message):
            local_device_ids(bad, _job(), {})
    with pytest.raises(ValueError, match="JDIST_LOCAL_DEVICES='x'"):
        local_device_ids(None, _job(), {"JDIST_LOCAL_DEVICES": "x"})


def test_describe_before_init_reads_the_environment():
    job = detect_job({})
    assert job.source == "single" and "one process" in job.reason
