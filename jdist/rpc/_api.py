"""Public RPC functions: validate, find this process's agent, delegate.

One module singleton (:data:`_state`) holds the agent started by :func:`init_rpc` and the
rendezvous store. :func:`start_agent` / :func:`stop_agent` do the same for any number
of agents (tests run several in one process on the in-process transport).
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

from jdist.errors import (
    AlreadyInitializedError,
    NotInitializedError,
    RendezvousError,
    RpcTimeoutError,
)
from jdist.rpc._agent import RpcAgent
from jdist.rpc._futures import Future
from jdist.rpc._options import BackendType, RpcBackendOptions
from jdist.rpc._protocol import ControlOp, WorkerInfo
from jdist.rpc._rendezvous import PREFIX, check_name, rendezvous, store_barrier
from jdist.rpc._rref import RRef
from jdist.rpc._state import current_agent, state
from jdist.rpc.autograd._hooks import install as install_autograd

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
    "get_rpc_timeout",
    "current_agent",
    "start_agent",
    "stop_agent",
]


_state = state


def _env_int(value: int | None, var: str, what: str) -> int:
    if value is not None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{what} must be an int, got {value!r}")
        return value
    raw = os.environ.get(var)
    if raw is None:
        raise ValueError(f"{what} not given and ${var} is not set; pass {what}= or launch with "
                         "jdist-run")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${var} must be an int, got {raw!r}") from None


def _same_processes(group: Any, rank: int, world_size: int) -> bool:
    """Whether the RPC job is the process group's own job (same rank, same size)."""
    try:
        return (group.get_rank(), group.get_world_size()) == (rank, world_size)
    except Exception:  # not initialised, or torn down meanwhile
        return False


def _make_store(init_method: Any, rank: int, world_size: int, timeout: float,
                key: bytes | None) -> tuple[Any, bool]:
    """The rendezvous store and whether we own it (and must close it at shutdown)."""
    if all(hasattr(init_method, m) for m in ("set", "get", "add", "compare_set")):
        return init_method, False
    # the process group's store, if jdist.collectives is in use (importing it loads jax)
    group = sys.modules.get("jdist.collectives._group")
    runtime = group.group_state.runtime if group is not None else None
    pg_store = runtime.get("store") if runtime else None
    if pg_store is not None and not _same_processes(group, rank, world_size):
        pg_store = None  # another set of processes: rendezvous on init_method, as torch
    if pg_store is not None and init_method == "env://":
        # torch reuses the process group's store; a per-init prefix keeps old keys apart
        from jdist.store import PrefixStore

        _state.generation += 1
        return PrefixStore(f"rpc-{_state.generation}", pg_store), False
    if not isinstance(init_method, str):
        raise TypeError(f"init_method must be 'env://', 'tcp://host:port' or a store, "
                        f"got {init_method!r}")
    if init_method == "env://":
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT")
        if port is None:
            raise ValueError("init_method='env://' needs $MASTER_PORT (and $MASTER_ADDR); "
                             "launch with jdist-run or set them")
    elif init_method.startswith("tcp://"):
        from jdist.rpc.transport._tcp import split_host_port

        host, port = split_host_port(init_method[len("tcp://"):])
    else:
        raise ValueError(f"init_method must be 'env://' or 'tcp://host:port', "
                         f"got {init_method!r}")
    from jdist.store import TCPStore

    return TCPStore(host, int(port), world_size, rank == 0, timedelta(seconds=timeout),
                    auth_token=None if key is None else key), True


def _shared_key(store: Any, rank: int, timeout: float) -> bytes:
    warnings.warn("jdist.rpc: no JDIST_AUTH_TOKEN or RpcBackendOptions(auth_token=) given; "
                  "rank 0 made a secret and shares it through the rendezvous store, which is "
                  "only as safe as that store. Set JDIST_AUTH_TOKEN (jdist-run does).",
                  RuntimeWarning, stacklevel=3)
    key = f"{PREFIX}/auth"
    if rank == 0:
        store.compare_set(key, "", secrets.token_hex(32))
    deadline = time.monotonic() + timeout
    while store.add(f"{PREFIX}/auth_ready", 0) < 1 and rank != 0:
        if time.monotonic() > deadline:
            raise RendezvousError("rank 0 never published the RPC secret")
        time.sleep(0.01)
    if rank == 0:
        store.add(f"{PREFIX}/auth_ready", 1)
    v = store.get(key)
    return v.encode() if isinstance(v, str) else bytes(v)


def start_agent(name: str, rank: int, world_size: int, options: RpcBackendOptions,
                store: Any, auth_key: bytes | None = None,
                on_started: Any = None) -> RpcAgent:
    """Start an agent, rendezvous through ``store`` and return it (no singleton).

    ``on_started(agent)`` runs once it listens, before the rendezvous: peers may call
    it from then on (their calls wait until the worker table is installed).
    """
    check_name(name)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1} for world_size={world_size}, "
                         f"got {rank}")
    key = auth_key or options.auth_key() or _shared_key(store, rank, options.rendezvous_timeout)
    agent = RpcAgent(name, rank, world_size, options, key)
    install_autograd(agent)  # the core knows no autograd: its hooks are set here
    agent.start()
    if on_started is not None:
        on_started(agent)
    try:
        t0 = time.monotonic()
        table = rendezvous(store, name, rank, world_size, agent.address,
                           options.rendezvous_timeout)
        if os.environ.get("JDIST_RPC_DEBUG"):
            print(f"rendezvous of {name} took {time.monotonic() - t0:.3f} s", flush=True)
    except BaseException:
        agent.close()
        raise
    agent.set_workers(table)
    agent.store = store
    return agent


def init_rpc(name: str, rank: int | None = None, world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None,
             _torch_options: RpcBackendOptions | None = None, *,
             backend: BackendType | None = None) -> None:
    """Start this process's RPC agent and meet the other workers.

    Args:
      name: this worker's unique name.
      rank: its id (default ``$RANK``).
      world_size: number of workers (default ``$WORLD_SIZE``).
      rpc_backend_options: :class:`RpcBackendOptions` (default: env://, 60 s timeout,
        16 threads, secret from ``$JDIST_AUTH_TOKEN``).
      backend: ``None`` or ``BackendType.TENSORPIPE`` (torch's argument). torch's
        positional order ``init_rpc(name, backend, rank, world_size, options)`` is
        recognised when the second argument is a ``BackendType``.

    Raises:
      AlreadyInitializedError: already initialized (call ``shutdown()`` first).
      RendezvousError: the name is taken, or world sizes disagree.
      RendezvousTimeoutError: some workers never arrived (named).
    """
    if isinstance(rank, BackendType):  # torch's order: (name, backend, rank, ws, options)
        backend, rank, world_size, rpc_backend_options = (rank, world_size,
                                                          rpc_backend_options, _torch_options)
    elif _torch_options is not None:
        raise TypeError("init_rpc takes (name, rank, world_size, rpc_backend_options), or "
                        "torch's (name, backend, rank, world_size, rpc_backend_options)")
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(f"Argument backend must be a member of BackendType, got {backend!r}; "
                        "pass jdist.rpc.BackendType.TENSORPIPE or leave it out")
    options = RpcBackendOptions() if rpc_backend_options is None else rpc_backend_options
    if not isinstance(options, RpcBackendOptions):
        raise TypeError(f"Argument rpc_backend_options must be an instance of "
                        f"RpcBackendOptions, got {options!r}; build one: "
                        "jdist.rpc.RpcBackendOptions(init_method=..., rpc_timeout=...)")
    check_name(name)
    rank = _env_int(None if rank == -1 else rank, "RANK", "rank")
    world_size = _env_int(world_size, "WORLD_SIZE", "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with _state.lock:
        if _state.agent is not None:
            raise AlreadyInitializedError(f"RPC is already initialized as {_state.agent.info}; "
                                          "call jdist.rpc.shutdown() first")
        store, owns = _make_store(options.init_method, rank, world_size,
                                  options.rendezvous_timeout, options.auth_key())
        def publish(agent: RpcAgent) -> None:
            _state.agent = agent

        try:
            start_agent(name, rank, world_size, options, store, on_started=publish)
        except BaseException:
            _state.agent = None
            if owns:
                _close(store)
            raise
        _state.store, _state.owns_store = store, owns


def stop_agent(agent: RpcAgent, graceful: bool = True, timeout: float | None = None) -> None:
    """Shut ``agent`` down; graceful: drain, meet every live worker, then close.

    ``timeout=None`` waits as long as the workers that have not arrived are alive and
    answer (torch's default waits forever), giving up on one that stops answering for
    ``RpcBackendOptions.shutdown_timeout`` s; ``timeout > 0`` bounds the whole wait;
    ``timeout=0`` waits without any bound (torch's ``timeout=0``).

    Raises:
      RpcTimeoutError: graceful shutdown gave up waiting for live workers (named); the
        agent is closed anyway.
    """
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
        raise ValueError(f"shutdown timeout must be seconds >= 0 (0 = no timeout) or None, "
                         f"got {timeout!r}")
    store = getattr(agent, "store", None)
    missing: list[int] = []
    dead: dict[int, str] = {}
    silent: list[int] = []
    if graceful and store is not None and agent.state == "running":
        deadline = math.inf if not timeout else time.monotonic() + float(timeout)
        limit = agent.options.shutdown_timeout if timeout is None else math.inf
        missing, dead, silent = _graceful(agent, store, deadline, limit)
    agent.close()
    if dead:
        names = ", ".join(f"{agent.worker_info(r)} ({why})" for r, why in sorted(dead.items()))
        warnings.warn(f"jdist.rpc: {agent.info} shut down without these workers: {names}",
                      RuntimeWarning, stacklevel=2)
    if missing:
        who = [str(agent.worker_info(r)) for r in missing]
        if silent:
            why = (f"they are alive but did not answer for "
                   f"{agent.options.shutdown_timeout:g} s (RpcBackendOptions."
                   "shutdown_timeout): hung or stopped?")
        else:
            why = (f"waited {float(timeout):g} s (shutdown(timeout=)); they are alive but "
                   "did not call shutdown()")
        raise RpcTimeoutError(f"graceful shutdown of {agent.info} timed out waiting for "
                              f"{who}: {why}. The agent is closed anyway.")


class _Liveness:
    """While shutdown waits: ping the missing workers; report those silent too long."""

    def __init__(self, agent: RpcAgent, limit: float):
        self.agent, self.limit = agent, limit
        now = time.monotonic()
        self.last = {r: now for r in range(agent.world_size)}
        self.pings: dict[int, Any] = {}
        self.silent: list[int] = []

    def __call__(self, ranks: list[int]) -> bool:
        now = time.monotonic()
        for r in ranks:
            self.agent.probe(r)  # connecting marks a vanished worker dead
            ping = self.pings.get(r)
            if ping is not None and ping.done():
                if ping.exception() is None:
                    self.last[r] = now
                ping = self.pings.pop(r)
            if r not in self.pings and r not in self.agent.dead_workers():
                try:
                    self.pings[r] = self.agent.send_control(r, ControlOp.PING)
                except Exception:  # noqa: BLE001 - the next round probes again
                    pass
        self.silent = [r for r in ranks if r not in self.agent.dead_workers()
                       and now - self.last[r] > self.limit]
        return bool(self.silent)


def _graceful(agent: RpcAgent, store: Any, deadline: float,
              limit: float) -> tuple[list[int], dict, list[int]]:
    """Drain and meet the live workers; (missing live ranks, workers that died first,
    the missing ones given up on for not answering)."""
    rank, ws = agent.info.id, agent.world_size

    def gone(r: int) -> bool:
        return r in agent.dead_workers()

    alive = _Liveness(agent, limit)
    try:
        if not agent.drain(deadline, alive) and alive.silent:  # our own calls hang on them
            return alive.silent, agent.dead_workers(), alive.silent
        missing = store_barrier(store, "sd1", rank, ws, deadline, gone, alive)
        dead = agent.dead_workers()
        if missing:
            return missing, dead, alive.silent
        agent.quiet_leaves = True  # everyone is done: peers closing now is no failure
        agent.drain(deadline)
        missing = store_barrier(store, "sd2", rank, ws, deadline, gone, alive)
        if missing:
            return missing, dead, alive.silent
        agent.state = "stopping"
        if rank == 0:  # the store host leaves last, once the others are done reading it
            store_barrier(store, "sd3", rank, ws, min(deadline, time.monotonic() + 5), gone)
        else:
            store.add(f"{PREFIX}/sd3/{rank}", 1)
    except Exception as e:  # the store itself is gone (its host died): close locally
        warnings.warn(f"jdist.rpc: {agent.info} could not coordinate shutdown through the "
                      f"store ({e!r}); closing locally", RuntimeWarning, stacklevel=3)
        return [], agent.dead_workers(), []
    return [], dead, []


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Stop RPC in this process.

    Args:
      graceful: wait until this worker's outstanding calls and RRef messages are done,
        and until every live worker has called ``shutdown`` (so each worker's
        outstanding work, wherever it runs, is done first; workers known to be dead
        are skipped and named in a warning); ``False``: close at once.
      timeout: ``None`` (default): wait as long as the missing workers are alive and
        answer, giving up on one silent for ``RpcBackendOptions.shutdown_timeout`` s;
        seconds > 0: bound on the whole wait; ``0``: no bound at all (torch's default).

    Raises:
      RpcTimeoutError: live workers did not join (named); this worker is shut down
        anyway.
    """
    agent = _state.agent
    if agent is None:
        raise NotInitializedError("RPC has not been initialized: nothing to shut down "
                                  "(call jdist.rpc.init_rpc first)")
    try:
        stop_agent(agent, graceful, timeout)  # still serving peers until it closes
    finally:
        with _state.lock:
            store, _state.store, _state.agent = _state.store, None, None
            owns, _state.owns_store = _state.owns_store, False
        if owns:
            _close(store)


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            pass


def rpc_async(to: Any, func: Any, args: tuple | None = None, kwargs: dict | None = None,
              timeout: float = -1) -> Future:
    """Run ``func(*args, **kwargs)`` on worker ``to`` (name, rank or WorkerInfo).

    Returns a :class:`Future` of the result. ``timeout`` in seconds: -1 uses
    ``rpc_timeout``, 0 means none; on expiry the future fails with RpcTimeoutError.
    """
    return current_agent().rpc_async(to, func, args, kwargs, timeout)


def rpc_sync(to: Any, func: Any, args: tuple | None = None, kwargs: dict | None = None,
             timeout: float = -1) -> Any:
    """Run ``func(*args, **kwargs)`` on ``to`` and return its result.

    A remote exception is raised here with its original type and the remote traceback.

    Raises:
      RpcTimeoutError: no answer within ``timeout`` (names worker, function, time).
      WorkerUnavailableError: the worker is gone.
    """
    return current_agent().rpc_async(to, func, args, kwargs, timeout).wait()


def remote(to: Any, func: Any, args: tuple | None = None, kwargs: dict | None = None,
           timeout: float = -1) -> RRef:
    """Run ``func`` on ``to``, keep the result there and return an :class:`RRef` to it.

    Returns at once; an error in ``func`` shows up on ``to_here()`` / proxies.
    """
    return current_agent().remote(to, func, args, kwargs, timeout)


def get_rpc_timeout() -> float:
    """The default per-call timeout in seconds (``RpcBackendOptions.rpc_timeout``)."""
    return float(current_agent().options.rpc_timeout)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """``WorkerInfo(id, name)`` of ``worker_name`` (default: this worker)."""
    return current_agent().worker_info(worker_name)
