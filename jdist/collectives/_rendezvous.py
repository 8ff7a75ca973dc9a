"""Rendezvous: from ``init_method`` / environment to an agreed job, through a store.

Pure parsing (:func:`parse_init`) is separate from the blocking protocol
(:func:`rendezvous`) so both can be tested on their own.

Protocol (every key under ``jdist/rdzv/<generation>/``):

1. each rank claims ``rank/<r>`` with ``compare_set`` and its info (world size, host,
   pid): a second claimant of the same rank is refused;
2. each rank polls until it has seen every rank's info, comparing world sizes (a
   disagreement is published under ``error`` so that every rank fails, not only one);
3. rank 0 picks a free port for JAX's coordination service and publishes
   ``coordinator``; the others read it.

Missing ranks after ``timeout`` raise :class:`RendezvousTimeoutError` naming them.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.parse
from datetime import timedelta
from typing import Any, NamedTuple

from jdist.errors import RendezvousError, RendezvousTimeoutError, StoreError
from jdist.launch.cluster import JobSpec, detect_job
from jdist.store import free_port

__all__ = ["InitSpec", "parse_init", "parse_timeout", "make_store", "rendezvous",
           "RendezvousResult", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 1800.0  # torch's default for non-NCCL backends (30 min)


class InitSpec(NamedTuple):
    """Where and how to rendezvous, resolved from arguments, URL and environment.

    Attributes:
      kind: ``"env"``, ``"tcp"``, ``"file"`` or ``"store"``.
      rank: this process's rank.
      world_size: number of processes.
      host: the store host (tcp/env), else None.
      port: the store port (tcp/env), else None.
      path: the FileStore path (file), else None.
    """

    kind: str
    rank: int
    world_size: int
    host: str | None = None
    port: int | None = None
    path: str | None = None


def parse_timeout(timeout: Any) -> float:
    """Seconds from ``None`` (30 min), a ``timedelta`` or a positive number."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        raise ValueError(
            f"timeout must be a positive number of seconds or a datetime.timedelta, "
            f"got {timeout!r}"
        )
    return float(seconds)


def _env(name: str, required: bool, env) -> str | None:
    value = env.get(name)
    if required and (value is None or value == ""):
        raise ValueError(
            f"Error initializing jdist using env:// rendezvous: environment variable "
            f"{name} expected, but not set; set it (jdist-run sets RANK, WORLD_SIZE, "
            f"MASTER_ADDR and MASTER_PORT) or pass it to init_process_group"
        )
    return value


def _int(value, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def _merge(arg: int, query: dict, key: str) -> int:
    if key in query:
        q = _int(query[key][0], f"{key} in init_method")
        if arg not in (-1, None) and arg != q:
            raise ValueError(
                f"init_process_group got {key}={arg} and {key}={q} in init_method; "
                f"give it once"
            )
        return q
    return -1 if arg is None else arg


def parse_init(init_method: str | None, world_size: int, rank: int, store: Any,
               env=None) -> InitSpec:
    """Resolve rank, world size and the rendezvous kind (no I/O).

    A world size of 1, or none at all under ``env://``, means the embedded single
    process: no host or port is needed.

    Raises:
      ValueError: conflicting arguments, a missing environment variable (named), a bad
        URL, or a rank outside ``[0, world_size)``.
    """
    env = os.environ if env is None else env
    if store is not None:
        if init_method is not None:
            raise ValueError("Cannot specify both init_method and store.")
        if world_size is None or world_size <= 0 or rank is None or rank < 0:
            raise ValueError(
                f"init_process_group(store=...) needs world_size > 0 and rank >= 0, got "
                f"world_size={world_size}, rank={rank}"
            )
        return _checked(InitSpec("store", rank, world_size))
    method = init_method or "env://"
    url = urllib.parse.urlparse(method)
    query = urllib.parse.parse_qs(url.query)
    rank = _merge(rank, query, "rank")
    world_size = _merge(world_size, query, "world_size")
    if url.scheme == "env":
        return _from_env(rank, world_size, env)
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ValueError(f"init_method {method!r} must look like tcp://host:port")
        if world_size == -1 or rank == -1:
            raise ValueError(
                f"init_method {method!r} needs rank and world_size (arguments or "
                f"?rank=&world_size= in the URL)"
            )
        return _checked(InitSpec("tcp", rank, world_size, url.hostname, url.port))
    if url.scheme == "file":
        path = urllib.parse.unquote(url.path)
        if not path:
            raise ValueError(f"init_method {method!r} must look like file:///path/to/file")
        if world_size == -1 or rank == -1:
            raise ValueError(
                f"init_method {method!r} needs rank and world_size (arguments or "
                f"?rank=&world_size= in the URL)"
            )
        return _checked(InitSpec("file", rank, world_size, path=path))
    raise ValueError(
        f"init_method {method!r} is not supported; use env://, tcp://host:port or "
        f"file:///path"
    )


def _with_args(env, rank: int, world_size: int):
    """``env`` with an explicit rank / world size filling a torchrun pair's other half."""
    if (rank == -1) == (world_size == -1):
        return env
    name, other, value = (("RANK", "WORLD_SIZE", rank) if rank != -1
                          else ("WORLD_SIZE", "RANK", world_size))
    if env.get(other) and not env.get(name):
        return {**env, name: str(value)}
    return env


def describe(init_method: str | None, world_size: int, rank: int, store: Any,
             spec: InitSpec, env=None) -> JobSpec:
    """The :class:`JobSpec` behind ``spec``: what was detected, or the explicit arguments."""
    env = os.environ if env is None else env
    explicit = store is not None or (init_method not in (None, "env://")) or (
        rank != -1 and world_size != -1)
    if not explicit:
        job = detect_job(_with_args(env, rank, world_size))
        if (job.rank, job.world_size) == (spec.rank, spec.world_size):
            return job
        why = f"{job.reason}; overridden by init_process_group(rank={rank}, " \
              f"world_size={world_size})"
        return job._replace(rank=spec.rank, world_size=spec.world_size, reason=why)
    how = (f"init_process_group(store={type(store).__name__})" if store is not None else
           f"init_process_group(init_method={init_method!r}, rank={rank}, "
           f"world_size={world_size})")
    single = spec.world_size == 1
    return JobSpec("explicit", spec.rank, spec.world_size, 0, 1, 0, 1,
                   None if single else spec.host or spec.path, None if single else spec.port,
                   None, 0, f"arguments: {how}")


def _from_env(rank: int, world_size: int, env) -> InitSpec:
    """``env://``: explicit arguments first, then the job :func:`detect_job` finds."""
    if rank != -1 and world_size != -1:  # both given: only the address comes from env
        if world_size == 1:
            return _checked(InitSpec("env", rank, 1))
        host = _env("MASTER_ADDR", True, env)
        port = _int(_env("MASTER_PORT", True, env), "MASTER_PORT")
        return _checked(InitSpec("env", rank, world_size, host, port))
    job = detect_job(_with_args(env, rank, world_size))
    if world_size == -1:
        world_size = job.world_size
    if rank == -1:
        rank = job.rank
    if world_size == 1:
        return _checked(InitSpec("env", rank, 1))
    if job.master_addr is None:  # world_size given, nothing detected
        _env("RANK", rank == -1, env)
        host = _env("MASTER_ADDR", True, env)
        port = _int(_env("MASTER_PORT", True, env), "MASTER_PORT")
        return _checked(InitSpec("env", rank, world_size, host, port))
    return _checked(InitSpec("env", rank, world_size, job.master_addr, job.master_port))


def _checked(spec: InitSpec) -> InitSpec:
    if not isinstance(spec.world_size, int) or spec.world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {spec.world_size!r}")
    if not isinstance(spec.rank, int) or not 0 <= spec.rank < spec.world_size:
        raise ValueError(
            f"Invalid rank {spec.rank!r}, rank should be in the interval "
            f"[0, {spec.world_size - 1}] for world_size={spec.world_size}; give each "
            f"process a distinct RANK below WORLD_SIZE"
        )
    return spec


def make_store(spec: InitSpec, timeout: float):
    """Create the store named by ``spec`` (rank 0 hosts the TCPStore)."""
    if spec.kind == "file":
        from jdist.store import FileStore

        return FileStore(spec.path, spec.world_size)
    from jdist.store import TCPStore

    deadline = time.monotonic() + timeout
    while True:
        try:
            return TCPStore(spec.host, spec.port, spec.world_size, spec.rank == 0,
                            timedelta(seconds=timeout), wait_for_workers=False)
        except (StoreError, OSError) as exc:
            if spec.rank == 0 or time.monotonic() > deadline:
                where = f"{spec.host}:{spec.port}"
                raise RendezvousError(
                    f"rank {spec.rank} could not {'host' if spec.rank == 0 else 'reach'} "
                    f"the rendezvous store at {where}: {exc}; check MASTER_ADDR/"
                    f"MASTER_PORT (the port must be free on rank 0's host)"
                ) from exc
            time.sleep(0.1)


class RendezvousResult(NamedTuple):
    """What every rank learned: each rank's info and the JAX coordinator address."""

    infos: tuple[dict, ...]
    coordinator: str


def _raise_published(store, prefix: str) -> None:
    """Raise the error another rank published for this rendezvous, if any."""
    key = prefix + "error"
    if not store.check([key]):
        return
    msg = store.get(key).decode()
    _ack_error(store, prefix)
    if msg.startswith("timeout:"):
        raise RendezvousTimeoutError(msg[len("timeout:"):])
    raise RendezvousError(msg)


def _ack_error(store, prefix: str) -> None:
    """Tell rank 0 this rank has read the published error (rank 0 keeps its store up
    until all have, or until its own deadline). Best effort: if rank 0 has closed the
    store already, the error is raised anyway; a failed acknowledgement must not turn
    into a reconnect that waits for a store that is gone."""
    try:
        store.add(prefix + "error_seen", 1)
    except StoreError:
        pass


def _wait_count(store, key: str, count: int, wait: float) -> None:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if count <= 0 or (store.check([key]) and int(store.get(key)) >= count):
            return
        time.sleep(0.01)


def _poll(store, prefix: str, keys: list[str], deadline: float, what: str):
    """Wait (polling, so errors published by peers are seen) until ``keys`` exist."""
    sleep = 0.01
    while True:
        _raise_published(store, prefix)
        missing = [k for k in keys if not store.check([k])]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError(what.format(missing=missing))
        time.sleep(sleep)
        sleep = min(sleep * 1.5, 0.2)


def rendezvous(store, spec: InitSpec, timeout: float, generation: int,
               coordinator_host: str) -> RendezvousResult:
    """Run the protocol in the module docstring; return every rank's info.

    Raises:
      RendezvousError: world sizes disagree or a rank is claimed twice (on every rank
        that sees it).
      RendezvousTimeoutError: some ranks did not arrive within ``timeout``; names them.
    """
    prefix = f"jdist/rdzv/{generation}/"
    rank, n = spec.rank, spec.world_size
    deadline = time.monotonic() + timeout
    mine = json.dumps({"world_size": n, "host": socket.gethostname(), "pid": os.getpid(),
                       "rank": rank}, sort_keys=True)
    got = store.compare_set(prefix + f"rank/{rank}", "", mine)
    got = got.decode() if isinstance(got, bytes) else str(got)
    if got != mine:
        other = json.loads(got)
        raise RendezvousError(
            f"rank {rank} was claimed twice: by pid {other.get('pid')} on host "
            f"{other.get('host')!r} and by this process (pid {os.getpid()}); give every "
            f"process a distinct RANK"
        )
    infos: dict[int, dict] = {rank: json.loads(mine)}
    if rank != 0:
        deadline += 1.0  # rank 0 decides a timeout first and tells everyone
    sleep = 0.01
    while len(infos) < n:
        _raise_published(store, prefix)
        for r in range(n):
            key = prefix + f"rank/{r}"
            if r in infos or not store.check([key]):
                continue
            info = json.loads(store.get(key).decode())
            infos[r] = info
            if info["world_size"] != n:
                msg = (
                    f"world size mismatch: rank {rank} was started with world_size={n} "
                    f"but rank {r} with world_size={info['world_size']}; give every "
                    f"process the same WORLD_SIZE"
                )
                store.set(prefix + "error", msg)
                if rank == 0:  # the ranks that arrived read it before the store goes away
                    _wait_count(store, prefix + "error_seen", len(infos) - 1,
                                max(2.0, deadline - time.monotonic()))
                else:
                    _ack_error(store, prefix)
                raise RendezvousError(msg)
        if len(infos) == n:
            break
        if time.monotonic() > deadline:
            missing = [r for r in range(n) if r not in infos]
            msg = (f"init_process_group timed out after {timeout:g} s on rank {rank}: ranks "
                   f"{missing} of world_size {n} never arrived at the rendezvous; check that "
                   f"those processes started with the same MASTER_ADDR/MASTER_PORT, or "
                   f"raise timeout=")
            if rank == 0:  # tell the ranks that did arrive, before the store goes away
                store.set(prefix + "error", "timeout:" + msg)
                _wait_count(store, prefix + "error_seen", len(infos) - 1, 2.0)
            raise RendezvousTimeoutError(msg)
        time.sleep(sleep)
        sleep = min(sleep * 1.5, 0.2)
    coord_key = prefix + "coordinator"
    if rank == 0:
        coordinator = f"{coordinator_host}:{free_port(coordinator_host)}"
        store.set(coord_key, coordinator)
    else:
        _poll(store, prefix, [coord_key], deadline,
              f"rank {rank}: rank 0 did not publish the JAX coordinator address within "
              f"{timeout:g} s (missing keys {{missing}})")
        coordinator = store.get(coord_key).decode()
    return RendezvousResult(tuple(infos[r] for r in range(n)), coordinator)
