"""Job detection from scheduler environments: a table of real-looking environments.

Each row is the environment a scheduler gives one process (as documented by SLURM,
Open MPI, PMI, Kubernetes and torchrun) and what jdist must make of it. The expected
ports are computed here from the documented rule (crc32 of the job id plus a slot per
step and restart), not read back from the code under test.
"""

from __future__ import annotations

import zlib

import pytest

from jdist.launch._cluster import detect_job
from jdist.launch._hostlist import expand_hostlist, expand_tasks_per_node


def _port(job, step=0, restart=0):
    return 12000 + (zlib.crc32(job.encode()) + step * 32 + restart) % 20480


def _slurm(procid, ntasks, localid, nodeid, nodelist, tasks_per_node, step="0", job="4242",
           **extra):
    env = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": step, "SLURM_PROCID": str(procid),
           "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(localid),
           "SLURM_NODEID": str(nodeid), "SLURM_STEP_NODELIST": nodelist,
           "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node}
    env.update(extra)
    return env


def _ompi(rank, size, local, local_size, uri="2818572288.0;tcp://10.1.0.5,172.17.0.2:39751"):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "OMPI_MCA_orte_hnp_uri": uri}


# (name, env, fqdn, (source, rank, world, local_rank, local_world, node, nnodes, addr, port))
CASES = [
    ("jdist-run", {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                   "MASTER_PORT": "29500", "JDIST_RUN_ID": "ab12"},
     None, ("jdist-run", 3, 4, 1, 2, 1, 2, "10.0.0.1", 29500)),
    ("torchrun", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400",
                  "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "2",
                  # inherited from the srun step that started torchrun: ignored
                  "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                  "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "n1"},
     None, ("torchrun", 0, 2, 0, 2, 0, 1, "127.0.0.1", 29400)),
    ("slurm one node", _slurm(1, 4, 1, 0, "gpu07", "4"),
     None, ("slurm", 1, 4, 1, 4, 0, 1, "gpu07", _port("4242"))),
    ("slurm ranges, node 2", _slurm(5, 8, 1, 2, "node[01-03,07]", "2(x4)"),
     None, ("slurm", 5, 8, 1, 2, 2, 4, "node01", _port("4242"))),
    ("slurm second step", _slurm(0, 2, 0, 0, "node[08-09]", "1(x2)", step="1"),
     None, ("slurm", 0, 2, 0, 1, 0, 2, "node08", _port("4242", 1))),
    ("slurm requeued", _slurm(0, 2, 0, 0, "node[08-09]", "1(x2)", SLURM_RESTART_COUNT="1"),
     None, ("slurm", 0, 2, 0, 1, 0, 2, "node08", _port("4242", 0, 1))),
    ("slurm uneven, MASTER_PORT exported",
     _slurm(2, 3, 0, 1, "a-ib[1-2]", "2,1", MASTER_PORT="23456"),
     None, ("slurm", 2, 3, 0, 1, 1, 2, "a-ib1", 23456)),
    ("open mpi one node", _ompi(1, 4, 1, 4),
     None, ("openmpi", 1, 4, 1, 4, 0, 1, "127.0.0.1", _port("2818572288"))),
    ("open mpi two nodes, inside an allocation",
     {**_ompi(3, 4, 1, 2), **_slurm(1, 2, 0, 1, "n[1-2]", "1(x2)")},
     None, ("openmpi", 3, 4, 1, 2, 1, 2, "10.1.0.5", _port("2818572288"))),
    ("pmix (PRRTE) with WORLD_SIZE", {"PMIX_RANK": "2", "PMIX_NAMESPACE": "prterun-h-77@1",
                                      "WORLD_SIZE": "3", "PMIX_LOCAL_RANK": "2",
                                      "PMIX_LOCAL_SIZE": "3"},
     None, ("pmi", 2, 3, 2, 3, 0, 1, "127.0.0.1", _port("prterun-h-77@1"))),
    ("mpich hydra, two nodes", {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1",
                                "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"},
     None, ("pmi", 3, 4, 1, 2, 1, 2, "h0", _port("pmi"))),
    ("kubernetes indexed job", {"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "4",
                                "HOSTNAME": "train-2"},
     "train-2.train-svc.default.svc.cluster.local",
     ("kubernetes", 2, 4, 0, 1, 2, 4, "train-0.train-svc.default.svc.cluster.local",
      _port("train"))),
    ("kubernetes jobset", {"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2", "JOB_INDEX": "0",
                           "JOBSET_NAME": "llm", "REPLICATED_JOB_NAME": "workers"},
     None, ("kubernetes", 1, 2, 0, 1, 1, 2, "llm-workers-0-0.llm", _port("llm-workers"))),
    ("plain python", {}, None, ("single", 0, 1, 0, 1, 0, 1, None, None)),
    ("sbatch script itself", {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                              "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "node[01-04]"},
     None, ("single", 0, 1, 0, 1, 0, 1, None, None)),
]


@pytest.mark.parametrize("name,env,fqdn,want", CASES, ids=[c[0] for c in CASES])
def test_detect_job_table(name, env, fqdn, want):
    spec = detect_job(env, fqdn=(lambda: fqdn) if fqdn else _no_fqdn)
    got = (spec.source, spec.rank, spec.world_size, spec.local_rank, spec.local_world_size,
           spec.node_rank, spec.nnodes, spec.master_addr, spec.master_port)
    assert got == want
    text = spec.describe()
    assert spec.source in text and spec.reason in text and spec.reason


def _no_fqdn():
    raise AssertionError("only a Kubernetes indexed Job without MASTER_ADDR may ask")


def test_every_rank_of_a_step_agrees_and_steps_and_restarts_never_share_a_port():
    ranks = [detect_job(_slurm(r, 8, r % 2, r // 2, "node[01-03,07]", "2(x4)"))
             for r in range(8)]
    assert {(s.master_addr, s.master_port) for s in ranks} == {("node01", _port("4242"))}
    assert sorted(s.rank for s in ranks) == list(range(8))
    ports = {detect_job(_slurm(0, 1, 0, 0, "n1", "1", step=str(step),
                               SLURM_RESTART_COUNT=str(restart))).master_port
             for step in range(40) for restart in range(8)}
    assert len(ports) == 40 * 8  # every (step, restart) of one job has its own port
    assert all(12000 <= p < 32480 for p in ports)
    other_job = detect_job(_slurm(0, 1, 0, 0, "n1", "1", job="4243")).master_port
    assert other_job != detect_job(_slurm(0, 1, 0, 0, "n1", "1")).master_port


def test_hostlists():
    assert expand_hostlist("node[01-04,07]") == ["node01", "node02", "node03", "node04",
                                                 "node07"]
    assert expand_hostlist("a,b[8-10]-ib,c") == ["a", "b8-ib", "b9-ib", "b10-ib", "c"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


BAD = [
    ({"RANK": "1"}, "RANK='1' is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE='4' is set but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "RANK=2 must be below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "MASTER_PORT='70000' must be in"),
    (_slurm(4, 4, 0, 0, "n[1-2]", "2(x2)"), "SLURM_PROCID=4 must be below SLURM_NTASKS=4"),
    (_slurm(0, 4, 0, 0, "n[1-2", "2(x2)"), "SLURM_STEP_NODELIST='n[1-2': '[' is never"),
    (_slurm(0, 4, 0, 0, "n[2-1]", "2(x2)"), "SLURM_STEP_NODELIST='n[2-1]': range '2-1'"),
    (_slurm(0, 4, 0, 0, "n[a-b]", "2(x2)"), "SLURM_STEP_NODELIST='n[a-b]'"),
    (_slurm(0, 4, 0, 0, "n[1-2]", "2(y2)"), "SLURM_STEP_TASKS_PER_NODE='2(y2)'"),
    (_slurm(0, 4, 0, 5, "n[1-2]", "2(x2)"), "SLURM_NODEID=5 must be below"),
    (_slurm(0, -1, 0, 0, "n1", "1"), "SLURM_NTASKS='-1' must be >= 1"),
    ({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"},
     "srun sets SLURM_PROCID but: SLURM_STEP_NUM_TASKS or SLURM_NTASKS"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ({**_ompi(0, 4, 0, 2, uri=""), "OMPI_MCA_orte_hnp_uri": ""}, "mpirun -x MASTER_ADDR"),
    ({"PMIX_RANK": "1"}, "PMIX_RANK=1 is set but the job size is not"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "export MASTER_ADDR"),
    ({"JOB_COMPLETION_INDEX": "1"}, "WORLD_SIZE is not set"),
    ({"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2"}, "subdomain"),
    ({"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a"},
     "JOB_COMPLETION_INDEX=2 must be below WORLD_SIZE=2"),
]


@pytest.mark.parametrize("env,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_environments_name_the_variable(env, message):
    with pytest.raises(ValueError) as info:
        detect_job(env, fqdn=lambda: "pod-1")
    assert message in str(info.value)
