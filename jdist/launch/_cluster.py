"""Which job is this process part of? Detection from the environment (pure, no JAX).

:func:`detect_job` reads an environment mapping and returns a :class:`JobSpec`: rank,
world size, local rank, the coordinator (the host and port of rank 0's rendezvous
store), where it came from and why. One small detector per source, tried in order:

1. ``torchrun`` / ``jdist-run`` variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``MASTER_ADDR``, ``MASTER_PORT``): a launcher said so, nothing is guessed;
2. Open MPI (``OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK/_LOCAL_SIZE``). It comes before
   SLURM because ``mpirun`` inside an allocation starts its daemons with ``srun``, so
   its processes inherit the SLURM variables of the daemons' step, not their own;
3. SLURM, in an ``srun`` step (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
   ``SLURM_STEP_NODELIST``, ``SLURM_JOB_ID``, ``SLURM_STEP_ID``). The batch script
   itself (``SLURM_JOB_ID`` without ``SLURM_STEP_ID``) is one process;
4. PMI / PMIx (``PMIX_RANK`` or ``PMI_RANK``, ``PMI_SIZE``; MPICH's Hydra, Intel MPI,
   PRRTE): PMIx keeps the job size in its server, so without ``PMI_SIZE`` it is read
   from ``WORLD_SIZE``;
5. a Kubernetes indexed Job or JobSet (``JOB_COMPLETION_INDEX``, ``WORLD_SIZE`` from
   the manifest, rank 0's host from the pod's headless-service name);
6. otherwise one process.

The coordinator port is derived from the job id, the step id and the restart count
(:func:`derived_port`), so a second ``srun`` step of one allocation, or a requeued
job, never meets the store of an earlier incarnation. ``MASTER_ADDR`` / ``MASTER_PORT``
set in the environment win over the derived values (the reason says so).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping
from typing import NamedTuple

from jdist.launch._hostlist import expand_hostlist, expand_tasks_per_node

__all__ = ["JobSpec", "detect_job", "derived_port", "local_device_ids", "PORT_BASE", "PORT_SPAN",
           "RESTART_SLOTS"]

PORT_BASE = 12000  # below Linux's ephemeral range (32768-60999)
PORT_SPAN = 20480
RESTART_SLOTS = 32  # (step, restart) pairs map to distinct ports for 640 steps x 32 restarts


class JobSpec(NamedTuple):
    """One process's place in its job, and where that came from.

    ``master_addr`` / ``master_port`` are None for a one-process job. ``source`` is one
    of ``"explicit"``, ``"jdist-run"``, ``"torchrun"``, ``"env"``, ``"openmpi"``,
    ``"slurm"``, ``"pmi"``, ``"kubernetes"``, ``"single"``.
    """

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str | None
    master_port: int | None
    job_id: str | None
    restart_count: int
    reason: str
    devices: str = "every local device this process sees"

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """A few lines for people: the detected job and why."""
        where = (f"{self.master_addr}:{self.master_port}" if self.master_addr
                 else "none (one process)")
        return (f"source: {self.source}\n"
                f"rank {self.rank} of {self.world_size} (local rank {self.local_rank} of "
                f"{self.local_world_size}, node {self.node_rank} of {self.nnodes})\n"
                f"coordinator: {where}\n"
                f"job id: {self.job_id or '-'}, restart {self.restart_count}\n"
                f"devices: {self.devices}\n"
                f"why: {self.reason}")


def derived_port(job_id: str, step: int = 0, restart: int = 0) -> int:
    """A port in ``[PORT_BASE, PORT_BASE + PORT_SPAN)`` for one (job, step, restart).

    Every process of a step computes the same port without talking to the others.
    Within one job, distinct ``(step, restart)`` pairs get distinct ports as long as
    ``step < PORT_SPAN // RESTART_SLOTS`` (640) and ``restart < RESTART_SLOTS`` (32).
    """
    slot = int(step) * RESTART_SLOTS + int(restart) % RESTART_SLOTS
    return PORT_BASE + (zlib.crc32(str(job_id).encode()) + slot) % PORT_SPAN


class _Env:
    """Typed, quoting reads of one environment mapping."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def has(self, name: str) -> bool:
        return self.env.get(name, "") != ""

    def str(self, *names: str) -> tuple[str | None, str | None]:
        """The first of ``names`` that is set: ``(name, value)``."""
        for n in names:
            if self.has(n):
                return n, self.env[n].strip()
        return None, None

    def int(self, *names: str, low: int = 0, default: int | None = None,
            need: str = "") -> int:
        name, value = self.str(*names)
        if name is None:
            if default is not None:
                return default
            raise ValueError(f"{need}: {' or '.join(names)} is not set")
        try:
            out = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer") from None
        if out < low:
            raise ValueError(f"{name}={value!r} must be >= {low}")
        return out


def _port(env: _Env) -> int | None:
    name, value = env.str("MASTER_PORT")
    if name is None:
        return None
    port = env.int("MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT={value!r} must be in [1, 65535]")
    return port


def _restarts(env: _Env) -> int:
    return env.int("JDIST_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", default=0)


def _check(source: str, rank: int, world: int, local: int, local_world: int,
           names: tuple[str, str, str, str]) -> None:
    if world < 1:
        raise ValueError(f"{names[1]}={world} must be >= 1 ({source})")
    if rank >= world:
        raise ValueError(f"{names[0]}={rank} must be below {names[1]}={world} ({source}); "
                         f"every process needs a distinct rank in [0, {world})")
    if local_world < 1 or local >= local_world:
        raise ValueError(f"{names[2]}={local} must be below {names[3]}={local_world} "
                         f"({source})")


_EXPECTED = "Error initializing jdist using env:// rendezvous: environment variable"


def _torchrun(env: _Env) -> JobSpec | None:
    if not env.has("RANK"):
        return None
    if not env.has("WORLD_SIZE"):
        raise ValueError(f"{_EXPECTED} WORLD_SIZE expected, but not set: RANK="
                         f"{env.env['RANK']!r} is set but WORLD_SIZE is not; set both "
                         f"(jdist-run and torchrun do), or neither")
    rank = env.int("RANK")
    world = env.int("WORLD_SIZE", low=1)
    local = env.int("LOCAL_RANK", default=rank)
    local_world = env.int("LOCAL_WORLD_SIZE", low=1, default=max(world, local + 1))
    _check("RANK/WORLD_SIZE", rank, world, local, local_world,
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if env.has("JDIST_RUN_ID"):
        source, who = "jdist-run", f"jdist-run (JDIST_RUN_ID={env.env['JDIST_RUN_ID']})"
    elif env.has("TORCHELASTIC_RUN_ID"):
        source, who = "torchrun", f"torchrun (TORCHELASTIC_RUN_ID=" \
                                  f"{env.env['TORCHELASTIC_RUN_ID']})"
    else:
        source, who = "env", "the environment (RANK and WORLD_SIZE, no launcher id)"
    addr = port = None
    if world > 1:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.has(n)]
        if missing:
            raise ValueError(f"{_EXPECTED} {missing[0]} expected, but not set: "
                             f"RANK={rank} WORLD_SIZE={world} are set but "
                             f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                             f" not; set the address and port of rank 0's host")
        addr, port = env.env["MASTER_ADDR"].strip(), _port(env)
    return JobSpec(source, rank, world, local, local_world,
                   env.int("GROUP_RANK", default=0), env.int("GROUP_WORLD_SIZE", low=1,
                                                                default=1),
                   addr, port, env.str("JDIST_RUN_ID", "TORCHELASTIC_RUN_ID")[1],
                   _restarts(env), f"RANK={rank}, WORLD_SIZE={world} set by {who}")


def _override(env: _Env, addr: str | None, port: int | None, why: list[str]):
    """``MASTER_ADDR`` / ``MASTER_PORT`` from the environment win over derived ones."""
    if env.has("MASTER_ADDR"):
        addr = env.env["MASTER_ADDR"].strip()
        why.append(f"MASTER_ADDR={addr} from the environment")
    p = _port(env)
    if p is not None:
        port = p
        why.append(f"MASTER_PORT={p} from the environment")
    return addr, port


_OMPI_URI_VARS = ("OMPI_MCA_orte_hnp_uri", "PMIX_SERVER_URI41", "PMIX_SERVER_URI4",
                  "PMIX_SERVER_URI3", "PMIX_SERVER_URI21", "PMIX_SERVER_URI2")


def _uri_host(uri: str) -> str | None:
    m = re.search(r"tcp[46]?://\[?([^,:/\]]+)", uri)
    return m.group(1) if m else None


def _openmpi(env: _Env) -> JobSpec | None:
    if not env.has("OMPI_COMM_WORLD_RANK"):
        return None
    need = "Open MPI sets OMPI_COMM_WORLD_RANK but"
    rank = env.int("OMPI_COMM_WORLD_RANK")
    world = env.int("OMPI_COMM_WORLD_SIZE", low=1, need=need)
    local = env.int("OMPI_COMM_WORLD_LOCAL_RANK", need=need)
    local_world = env.int("OMPI_COMM_WORLD_LOCAL_SIZE", low=1, need=need)
    _check("Open MPI", rank, world, local, local_world,
           ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE"))
    uri_name, uri = env.str(*_OMPI_URI_VARS)
    job = None
    if uri_name == "OMPI_MCA_orte_hnp_uri":
        job = uri.split(".", 1)[0].split(";", 1)[0]
    if not job:
        job = env.str("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")[1] or "ompi"
    why = [f"OMPI_COMM_WORLD_RANK={rank}, OMPI_COMM_WORLD_SIZE={world} set by mpirun"]
    if local_world == world:
        addr = "127.0.0.1"
        why.append("every rank on this node, so the coordinator is 127.0.0.1")
    else:
        addr = _uri_host(uri) if uri else None
        if addr is not None:
            why.append(f"coordinator: mpirun's host from {uri_name}")
    restart = _restarts(env)
    addr, port = _override(env, addr, derived_port(job, 0, restart), why)
    if addr is None:
        raise ValueError(f"Open MPI job over several nodes (OMPI_COMM_WORLD_SIZE={world}, "
                         f"OMPI_COMM_WORLD_LOCAL_SIZE={local_world}) but no host of "
                         f"mpirun in {' / '.join(_OMPI_URI_VARS)}; pass rank 0's host with "
                         f"mpirun -x MASTER_ADDR=<host>")
    nnodes = max(1, -(-world // local_world))
    return JobSpec("openmpi", rank, world, local, local_world,
                   min(rank // local_world, nnodes - 1), nnodes, addr, port, job, restart,
                   "; ".join(why))


def _slurm(env: _Env) -> JobSpec | None:
    if not env.has("SLURM_PROCID") or not env.has("SLURM_JOB_ID"):
        return None
    if not env.has("SLURM_STEP_ID") and not env.has("SLURM_STEPID"):
        return None  # the batch script, not an srun task
    need = "srun sets SLURM_PROCID but"
    rank = env.int("SLURM_PROCID")
    world = env.int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", low=1, need=need)
    local = env.int("SLURM_LOCALID", need=need)
    job = env.env["SLURM_JOB_ID"].strip()
    step = env.int("SLURM_STEP_ID", "SLURM_STEPID")
    list_name, nodelist = env.str("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if list_name is None:
        raise ValueError(f"{need} SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) is not set; "
                         f"rank 0's host cannot be found")
    hosts = expand_hostlist(nodelist, list_name)
    node = env.int("SLURM_NODEID", default=0)
    nnodes = env.int("SLURM_STEP_NUM_NODES", "SLURM_NNODES", low=1, default=len(hosts))
    if nnodes > len(hosts):
        raise ValueError(f"SLURM_STEP_NUM_NODES={nnodes} but {list_name}={nodelist!r} names "
                         f"only {len(hosts)} host(s)")
    if node >= nnodes:
        raise ValueError(f"SLURM_NODEID={node} must be below the step's {nnodes} node(s)")
    tpn_name, tpn = env.str("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tpn_name is not None:
        counts = expand_tasks_per_node(tpn, tpn_name)
        if node >= len(counts):
            raise ValueError(f"{tpn_name}={tpn!r} has no entry for SLURM_NODEID={node}")
        local_world = counts[node]
    else:
        local_world = max(1, world // nnodes)
    _check("SLURM", rank, world, local, local_world,
           ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"))
    restart = env.int("SLURM_RESTART_COUNT", default=0) + _restarts(env)
    why = [f"SLURM_PROCID={rank}, SLURM_NTASKS={world} set by srun (job {job}, step {step})",
           f"coordinator: first host of {list_name}={nodelist}",
           f"port from job {job}, step {step}, restart {restart}"]
    addr, port = _override(env, hosts[0], derived_port(job, step, restart), why)
    return JobSpec("slurm", rank, world, local, local_world, node, nnodes, addr, port,
                   f"{job}.{step}", restart, "; ".join(why))


def _pmi(env: _Env) -> JobSpec | None:
    rank_name, _ = env.str("PMIX_RANK", "PMI_RANK")
    if rank_name is None:
        return None
    rank = env.int(rank_name)
    size_name, _ = env.str("PMI_SIZE", "WORLD_SIZE")
    if size_name is None:
        raise ValueError(f"{rank_name}={rank} is set but the job size is not (PMIx keeps "
                         f"it in its server): set WORLD_SIZE, or start the job with mpirun "
                         f"/ srun, which jdist reads directly")
    world = env.int(size_name, low=1)
    local = env.int("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PMIX_LOCAL_RANK", default=-1)
    local_world = env.int("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "PMIX_LOCAL_SIZE", low=1,
                          default=0)
    if local < 0 or local_world == 0:  # no local numbers: needs MASTER_ADDR (below)
        local, local_world = 0, 1
    _check("PMI", rank, world, local, local_world,
           (rank_name, size_name, "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
    job = env.str("PMIX_NAMESPACE", "PMI_JOBID")[1] or "pmi"
    why = [f"{rank_name}={rank}, {size_name}={world} (PMI/PMIx job {job})"]
    addr = "127.0.0.1" if local_world == world else None
    if addr:
        why.append("every rank on this node, so the coordinator is 127.0.0.1")
    restart = _restarts(env)
    addr, port = _override(env, addr, derived_port(job, 0, restart), why)
    if addr is None:
        raise ValueError(f"PMI job over several nodes ({rank_name}={rank}, {size_name}="
                         f"{world}) and MASTER_ADDR is not set; export MASTER_ADDR=<rank 0's "
                         f"host> to every process")
    nnodes = max(1, -(-world // local_world))
    return JobSpec("pmi", rank, world, local, local_world, min(rank // local_world, nnodes - 1),
                   nnodes, addr, port, job, restart, "; ".join(why))


def _kubernetes(env: _Env, fqdn: Callable[[], str]) -> JobSpec | None:
    if not env.has("JOB_COMPLETION_INDEX"):
        return None
    index = env.int("JOB_COMPLETION_INDEX")
    if not env.has("WORLD_SIZE"):
        raise ValueError(f"JOB_COMPLETION_INDEX={index} (a Kubernetes indexed Job) but "
                         f"WORLD_SIZE is not set; set it to the Job's completions in the pod "
                         f"template (docs/cluster.md has a manifest)")
    world = env.int("WORLD_SIZE", low=1)
    why = [f"JOB_COMPLETION_INDEX={index} set by Kubernetes, WORLD_SIZE={world} from the "
           f"pod template"]
    if env.has("JOBSET_NAME"):
        jobset = env.env["JOBSET_NAME"].strip()
        rjob = env.str("REPLICATED_JOB_NAME")[1]
        job_index = env.int("JOB_INDEX", default=0)
        if rjob is None:
            raise ValueError(f"JOBSET_NAME={jobset!r} is set but REPLICATED_JOB_NAME is not")
        if job_index != 0:
            raise ValueError(f"JOB_INDEX={job_index}: a JobSet whose replicated job has "
                             f"several Jobs is not detected (each Job's pod count is not in "
                             f"the environment); use replicas: 1, or set RANK, WORLD_SIZE, "
                             f"MASTER_ADDR and MASTER_PORT")
        job = f"{jobset}-{rjob}"
        addr: str | None = f"{jobset}-{rjob}-0-0.{jobset}"
        why.append(f"coordinator: pod 0 of JobSet {jobset!r} ({addr})")
    else:
        addr, job = None, None
        if not env.has("MASTER_ADDR"):
            name = fqdn()
            host, _, domain = name.partition(".")
            m = re.fullmatch(r"(.+)-(\d+)", host)
            if m is None or int(m.group(2)) != index or not domain:
                raise ValueError(
                    f"JOB_COMPLETION_INDEX={index} but this pod's name {name!r} is not "
                    f"<job>-{index}.<service>: give the pod template subdomain: <a headless "
                    f"Service>, or set MASTER_ADDR")
            job = m.group(1)
            addr = f"{job}-0.{domain}"
            why.append(f"coordinator: pod 0 of Job {job!r} behind the same service ({addr})")
    _check("Kubernetes", index, world, 0, 1,
           ("JOB_COMPLETION_INDEX", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    restart = _restarts(env)
    addr, port = _override(env, addr, derived_port(job or "k8s", 0, restart), why)
    return JobSpec("kubernetes", index, world, 0, 1, index, world, addr, port, job, restart,
                   "; ".join(why))


def _single(env: _Env) -> JobSpec:
    if env.has("WORLD_SIZE") and env.env["WORLD_SIZE"].strip() != "1":
        raise ValueError(f"{_EXPECTED} RANK expected, but not set: WORLD_SIZE="
                         f"{env.env['WORLD_SIZE']!r} is set but RANK is not; set both "
                         f"(jdist-run and torchrun do), or neither")
    if env.has("SLURM_JOB_ID"):
        why = (f"SLURM_JOB_ID={env.env['SLURM_JOB_ID']} without an srun step "
               f"(no SLURM_STEP_ID/SLURM_PROCID): the batch script itself, one process; "
               f"start the tasks with srun")
    else:
        why = ("no launcher or scheduler variables (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, "
               "SLURM_PROCID, PMI_RANK, JOB_COMPLETION_INDEX): one process")
    return JobSpec("single", 0, 1, 0, 1, 0, 1, None, None, None, _restarts(env), why)


def _default_fqdn() -> str:
    import socket

    return socket.getfqdn()


def detect_job(env: Mapping[str, str] | None = None, *,
               fqdn: Callable[[], str] | None = None) -> JobSpec:
    """Detect this process's job from ``env`` (``os.environ`` when None).

    ``fqdn`` returns this host's fully qualified name (only a Kubernetes indexed Job
    without ``MASTER_ADDR`` asks for it; default ``socket.getfqdn``).

    Raises:
      ValueError: a variable with a nonsense value (quoted, e.g. ``SLURM_PROCID='4'
        must be below SLURM_NTASKS=4``) or a partial environment (names what is missing).
    """
    if env is None:
        import os

        env = os.environ
    e = _Env(env)
    for detector in (_torchrun, _openmpi, _slurm, _pmi):
        spec = detector(e)
        if spec is not None:
            return spec
    spec = _kubernetes(e, fqdn or _default_fqdn)
    return spec if spec is not None else _single(e)


def _visible(env: Mapping[str, str]) -> int | None:
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        value = env.get(name)
        if value:
            return len([v for v in value.split(",") if v.strip()])
    return None


def local_device_ids(policy, job: JobSpec,
                     env: Mapping[str, str]) -> tuple[tuple[int, ...] | None, str]:
    """Which local accelerators this process drives: ``(ids or None for all, why)``.

    ``policy``: ``None``/``"auto"`` (``JDIST_LOCAL_DEVICES`` if set, else one slice per
    task when SLURM says ``--gpus-per-task``, else all), ``"all"``, ``"one"`` (one per
    process, the local rank's), an int ``k`` (``k`` per process: ids ``[local_rank*k,
    local_rank*k + k)``) or a list of device ids. When the scheduler already made only
    ``k`` devices visible (``CUDA_VISIBLE_DEVICES``), the process takes all it sees.
    CPU devices are not affected (JAX applies the ids to GPUs only).

    Raises:
      ValueError: an unknown policy, quoting it (and ``JDIST_LOCAL_DEVICES`` if it
        came from there).
    """
    source = "local_devices"
    if policy is None or policy == "auto":
        if env.get("JDIST_LOCAL_DEVICES"):
            policy, source = env["JDIST_LOCAL_DEVICES"].strip(), "JDIST_LOCAL_DEVICES"
        elif job.source == "slurm" and env.get("SLURM_GPUS_PER_TASK"):
            policy, source = env["SLURM_GPUS_PER_TASK"].strip(), "SLURM_GPUS_PER_TASK"
        else:
            return None, "every local device this process sees (local_devices='all')"
    if isinstance(policy, str):
        text = policy.strip().lower()
        if text == "all":
            return None, f"every local device this process sees ({source}='all')"
        if text == "one":
            policy = 1
        elif re.fullmatch(r"\d+", text):
            policy = int(text)
        elif re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
            policy = [int(v) for v in text.split(",")]
        else:
            raise ValueError(f"{source}={policy!r} is not 'all', 'one', a count or a list "
                             f"of device ids like '0,1'")
    if isinstance(policy, bool) or not isinstance(policy, (int, list, tuple)):
        raise ValueError(f"{source}={policy!r} is not 'all', 'one', a count or a list of ids")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"{source}={policy!r} must be >= 1 device per process")
        if _visible(env) == policy:
            return None, (f"{policy} per process ({source}={policy}); the scheduler made "
                          f"exactly those visible")
        first = job.local_rank * policy
        ids = tuple(range(first, first + policy))
        return ids, f"{policy} per process ({source}): ids {list(ids)} for local rank " \
                    f"{job.local_rank}"
    ids = tuple(int(v) for v in policy)
    if not ids or any(i < 0 for i in ids):
        raise ValueError(f"{source}={policy!r}: give at least one device id >= 0")
    return ids, f"device ids {list(ids)} ({source})"
