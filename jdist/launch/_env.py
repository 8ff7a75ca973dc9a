"""What each worker process gets: its environment and its command line (pure functions)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["JobInfo", "worker_env", "worker_args", "worker_command", "restart_cache_env",
           "has_user_cache", "default_cache_dir", "default_cache_env", "cache_opted_out",
           "xla_flags_with_devices", "xla_threads"]


def xla_flags_with_devices(flags: str, devices: int) -> str:
    """``flags`` with ``--xla_force_host_platform_device_count`` set to ``devices``."""
    kept = [f for f in flags.split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    kept.append(f"--xla_force_host_platform_device_count={int(devices)}")
    return " ".join(kept)


def xla_threads(local_processes: int, cores: int | None = None) -> int:
    """The threads jdist-run gives XLA's CPU client in each of ``local_processes`` on a
    node of ``cores`` (default: this process's): its share, at least 2.

    XLA's CPU client also runs whole programs on that pool, and a blocking collective
    holds its thread until the peers join: with one thread, two programs in flight that
    the ranks dispatched in different orders wait for each other for ever (seen:
    pipelining's XLA point-to-point transfers). torch's ``OMP_NUM_THREADS=1`` is about
    compute threads only; set ``JDIST_XLA_CPU_THREADS=1`` yourself where a program has
    at most one collective in flight (``benchmarks/collectives.py`` does, as its torch
    side calls ``torch.set_num_threads(1)``).
    """
    if cores is None:
        from jdist._cores import usable_cores

        cores = usable_cores()
    return max(2, int(cores) // max(1, int(local_processes)))


class JobInfo(NamedTuple):
    """What the launchers agreed on for one attempt of the job."""

    world_size: int
    rank_offset: int  # global rank of this node's local rank 0
    nnodes: int
    node_rank: int
    local_world_size: int
    master_addr: str
    master_port: int  # the workers' rendezvous port (not the launchers' store port)
    token: str
    run_id: str
    restart_count: int  # the attempt's index: 0, then +1 per new round of workers
    max_restarts: int
    # restarts of the --max-restarts budget spent so far (None: ``restart_count``): a
    # round that only changes the members spends none, as in torch's agent
    restarts_spent: int | None = None


def worker_env(base: Mapping[str, str], job: JobInfo, local_rank: int,
               devices_per_proc: int | None, columns: int | None = None,
               compilation_cache: bool = True, cores: int | None = None) -> dict[str, str]:
    """The environment of local rank ``local_rank`` under ``job``.

    Sets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK, GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
    TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE, and TORCH_NCCL_ASYNC_ERROR_HANDLING
    unless set, as torch's agent sets them; the launcher adds TORCHELASTIC_ERROR_FILE,
    ``_blame.error_file_env``) and jdist's (JDIST_RESTART_COUNT, JDIST_MAX_RESTARTS,
    JDIST_AUTH_TOKEN, JDIST_RUN_ID and, with ``devices_per_proc``, XLA_FLAGS and
    JDIST_DEVICES_PER_PROC); with several processes on the node, OMP_NUM_THREADS=1
    unless set, and then XLA's CPU client on its share of the node's ``cores`` (default:
    this process's), at least 2: ``JDIST_XLA_CPU_THREADS`` unless set
    (:func:`xla_threads`). Python output is unbuffered so that lines reach the
    launcher as they are printed; ``columns`` (the console's width less the rank
    prefix) becomes COLUMNS, so progress bars fit the terminal. With
    ``compilation_cache`` (jdist-run's default; ``--no-compilation-cache`` or
    ``JDIST_COMPILATION_CACHE=0`` turn it off), JAX's persistent compilation cache is on:
    :func:`default_cache_env`.

    TORCHELASTIC_RESTART_COUNT is, as in torch's agent, the restarts spent of the
    budget (``job.restarts_spent``): a new round for a change of members (a launcher
    joined or was lost) leaves it as it was; JDIST_RESTART_COUNT is the attempt's index
    (``job.restart_count``), which every new round increments.

    TORCHELASTIC_USE_AGENT_STORE is ``False``: MASTER_PORT is a port of the workers'
    own (rank 0 hosts the store there, for ``jdist.init_process_group`` and for a torch
    process group alike), never the launchers' store. TORCH_NCCL_ASYNC_ERROR_HANDLING
    (torch's default ``1``; a value in the launcher's environment wins) matters only to
    torch's NCCL process groups that a script may create beside jdist's.
    """
    env = dict(base)
    env.update(
        RANK=str(job.rank_offset + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(job.world_size),
        LOCAL_WORLD_SIZE=str(job.local_world_size),
        GROUP_RANK=str(job.node_rank),
        GROUP_WORLD_SIZE=str(job.nnodes),
        ROLE_NAME="default",
        ROLE_RANK=str(job.rank_offset + local_rank),
        ROLE_WORLD_SIZE=str(job.world_size),
        MASTER_ADDR=job.master_addr,
        MASTER_PORT=str(job.master_port),
        JDIST_RESTART_COUNT=str(job.restart_count),
        JDIST_MAX_RESTARTS=str(job.max_restarts),
        JDIST_AUTH_TOKEN=job.token,
        JDIST_RUN_ID=job.run_id,
        TORCHELASTIC_RESTART_COUNT=str(job.restart_count if job.restarts_spent is None
                                       else job.restarts_spent),
        TORCHELASTIC_MAX_RESTARTS=str(job.max_restarts),
        TORCHELASTIC_RUN_ID=job.run_id,
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        PYTHONUNBUFFERED="1",
    )
    if columns is not None and columns > 0:
        env["COLUMNS"] = str(columns)
    if devices_per_proc is not None:
        env["XLA_FLAGS"] = xla_flags_with_devices(env.get("XLA_FLAGS", ""), devices_per_proc)
        env["JDIST_DEVICES_PER_PROC"] = str(devices_per_proc)
    if compilation_cache:
        env.update(default_cache_env(env))
    if job.local_world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
        if env["OMP_NUM_THREADS"] == "1":  # XLA's CPU threads too (jdist._xla_threads)
            env.setdefault("JDIST_XLA_CPU_THREADS",
                           str(xla_threads(job.local_world_size, cores)))
    return env


# The worker's program (jdist.launch._run_script): die with the launcher, then run the
# script or module as ``python`` would.
_SHIM = "import sys\nfrom jdist.launch._run_script import main\nmain(sys.argv[1:])\n"


CACHE_VARS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def has_user_cache(base: Mapping[str, str]) -> bool:
    """Whether ``base`` names a JAX compilation cache of its own."""
    return bool(base.get("JAX_COMPILATION_CACHE_DIR"))


_OFF = ("0", "off", "false", "no")


def cache_opted_out(base: Mapping[str, str]) -> bool:
    """Whether ``base`` turns jdist-run's default compilation cache off
    (``JDIST_COMPILATION_CACHE`` is 0, off, false or no)."""
    return base.get("JDIST_COMPILATION_CACHE", "").strip().lower() in _OFF


def default_cache_dir(base: Mapping[str, str]) -> str:
    """jdist-run's compilation cache directory: one per user and machine,
    ``$XDG_CACHE_HOME/jdist/jax-compilation-cache/<host>`` (``~/.cache`` without
    ``XDG_CACHE_HOME``), or ``JDIST_COMPILATION_CACHE`` where that names a directory.

    Not one per launch: JAX's cache key already holds everything a compiled program
    depends on (the program's text, jaxlib and backend versions, XLA flags, compile
    options, the devices' topology), so one directory serves every job of the user and
    a re-run of the same script loads all it compiled before. The host in the path keeps
    nodes that share a home directory (NFS) from writing into one directory.
    """
    named = base.get("JDIST_COMPILATION_CACHE", "").strip()
    if named and not cache_opted_out(base) and named.lower() not in ("1", "on", "true", "yes"):
        return os.path.abspath(os.path.expanduser(named))
    root = base.get("XDG_CACHE_HOME") or os.path.join(
        base.get("HOME") or os.path.expanduser("~"), ".cache")
    host = socket.gethostname().split(".")[0] or "localhost"
    return os.path.join(root, "jdist", "jax-compilation-cache", host)


def default_cache_env(base: Mapping[str, str]) -> dict[str, str]:
    """The variables that turn JAX's persistent compilation cache on for a worker:
    ``JAX_COMPILATION_CACHE_DIR`` (:func:`default_cache_dir`) and JAX's two thresholds
    at zero (every program is written, even a step that compiles in milliseconds),
    each only where ``base`` sets none. Empty when ``base`` names a cache of its own
    (``JAX_COMPILATION_CACHE_DIR``: the user's wins, with JAX's own thresholds) or opts
    out (``JDIST_COMPILATION_CACHE=0``)."""
    if has_user_cache(base) or cache_opted_out(base):
        return {}
    return restart_cache_env(base, default_cache_dir(base))


def restart_cache_env(base: Mapping[str, str], directory: str) -> dict[str, str]:
    """The variables that give a job's attempts one JAX compilation cache in
    ``directory``: every program an attempt compiles is written there (JAX's thresholds
    at zero, where the user set none), so a restarted attempt loads it instead of
    compiling again. Empty when ``base`` already names a cache (the user's wins)."""
    if has_user_cache(base):
        return {}
    out = {"JAX_COMPILATION_CACHE_DIR": directory}
    out.update({k: v for k, v in CACHE_VARS.items() if k not in base})
    return out


def worker_args(script: str, args: tuple[str, ...], module: bool) -> list[str]:
    """What the worker's program runs: ``mode target args...`` (mode ``script`` or
    ``module``)."""
    return ["module" if module else "script", script, *args]


def worker_command(launcher_pid: int, script: str, args: tuple[str, ...], module: bool,
                   python: str | None = None) -> list[str]:
    """The command line of one worker (``python -c SHIM pid mode script args...``)."""
    return [python or sys.executable, "-u", "-c", _SHIM, str(launcher_pid),
            *worker_args(script, args, module)]
