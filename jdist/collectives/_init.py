"""``init_process_group`` / ``destroy_process_group``: start and stop the runtime.

One process (no ``WORLD_SIZE``, or 1) is the *embedded* case: the default group is
this process and its local devices, and nothing touches the network. With more
processes: rendezvous through the store (rank 0 hosts a ``TCPStore`` on
``MASTER_PORT``; see ``_rendezvous``), rank 0 publishes a free port for JAX's
coordination service, every rank calls ``jax.distributed.initialize`` (CPU collectives
over gloo), and the default group is built from ``jax.devices()``: a mesh with axis
``"dp"`` over every device, process-major. A heartbeat thread (``_watchdog``) lets
collectives name a rank that died.

``destroy_process_group()`` stops all of it, so a later ``init_process_group`` in the
same process works (JAX's backends are cleared, so arrays made before are invalid).

A program that never calls ``destroy_process_group()`` (most torch scripts don't) gets
the same orderly teardown at interpreter exit: without it, rank 0 (host of JAX's
coordination service) can exit first and JAX then aborts the other ranks while they
disconnect. After an uncaught exception the exit teardown is skipped, so a failing rank
exits at once and the launcher can end the job.

Every process of a multi-process job writes its own persistent compilation cache
entries (``_compile_cache``): JAX writes them on process 0 only, and on CPU the other
processes' keys are their own, so a warm re-run would compile everything again there.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any

import jax

from jdist._xla_threads import limit_from_env
from jdist.collectives import _rendezvous as rdzv
from jdist.collectives._compile_cache import write_on_every_process
from jdist.collectives._group import (
    DEFAULT_AXIS,
    NON_GROUP_MEMBER,
    ProcessGroup,
    group_state,
    make_mesh,
)
from jdist.collectives._stuck import stuck_timeout_from
from jdist.collectives._watchdog import Watchdog
from jdist.errors import AlreadyInitializedError, RendezvousError, StoreError
from jdist.launch.cluster import JobSpec, detect_job, local_device_ids

__all__ = ["init_process_group", "destroy_process_group", "describe_job"]

_BACKENDS = ("gloo", "nccl")


def _check_backend(backend: Any) -> str | None:
    """The requested backend name (None = pick by platform); accepts torch's forms."""
    if backend is None:
        return None
    name = str(backend).lower()
    if name in _BACKENDS:
        return name
    if ":" in name:  # "cpu:gloo,cuda:nccl": pick by platform later
        parts = dict(p.split(":", 1) for p in name.split(",") if ":" in p)
        if set(parts.values()) <= set(_BACKENDS):
            return None
    raise ValueError(
        f"backend {backend!r} is not supported; use 'gloo' (CPU), 'nccl' (GPU) or None to "
        f"pick by platform"
    )


def _platform_backend(requested: str | None) -> str:
    platform = jax.default_backend()
    picked = "gloo" if platform == "cpu" else "nccl"
    if requested is not None and requested != picked:
        raise ValueError(
            f"backend {requested!r} does not match JAX's platform {platform!r} (which uses "
            f"{picked!r}); pass backend={picked!r} or None"
        )
    return picked


def _backends_initialized() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _clear_backends() -> None:
    import jax.extend.backend as jeb

    jeb.clear_backends()


def _xla_flag(flags: str, name: str) -> float | None:
    for f in flags.split():
        if f.startswith(f"--{name}="):
            try:
                return float(f.split("=", 1)[1])
            except ValueError:
                return None
    return None


def _set_collective_timeout(timeout: float) -> None:
    """Make a stuck CPU collective *raise* after the group timeout instead of hanging.

    XLA's gloo collectives raise after ``--xla_cpu_collective_timeout_seconds``, but
    abort the process after ``--xla_cpu_collective_call_terminate_timeout_seconds``
    (about 40 s by default). Unless the user set the first, it becomes the group
    timeout, capped 5 s below the abort so that the error wins. XLA reads its flags
    when its runtime starts, so this only acts before the first init of a process.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _xla_flag(flags, "xla_cpu_collective_timeout_seconds") is not None:
        return
    terminate = _xla_flag(flags, "xla_cpu_collective_call_terminate_timeout_seconds") or 40.0
    seconds = max(1, int(min(timeout, terminate - 5)))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_timeout_seconds={seconds}".strip()


def _start_jax(spec: rdzv.InitSpec, coordinator: str, timeout: float,
               device_ids: tuple[int, ...] | None = None) -> bool:
    """Start JAX's multi-process runtime; False if the user had already started it."""
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (spec.world_size, spec.rank):
            raise RendezvousError(
                f"jax.distributed was already initialized as process "
                f"{jax.process_index()} of {jax.process_count()}, but init_process_group "
                f"got rank {spec.rank} of world_size {spec.world_size}; make them agree"
            )
        return False
    if _backends_initialized():
        if group_state.generation > 1:
            _clear_backends()  # left over from this process's previous job
        else:
            raise RendezvousError(
                f"init_process_group(world_size={spec.world_size}) must run before any JAX "
                f"computation in this process (jax.devices(), creating arrays, jit calls "
                f"all start JAX's runtime); move it to the top of the program"
            )
    limit_from_env()  # (JDIST_XLA_CPU_THREADS under srun or mpirun: before JAX's client)
    _set_collective_timeout(timeout)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Recoverable tasks: a dead peer does not make JAX's coordination service abort the
    # survivors (they raise PeerFailedError instead) nor block their exit. Teardown is
    # synchronized by our own store barrier in destroy_process_group.
    jax.config.update("jax_enable_recoverability", True)
    # SIGTERM stays the program's: JAX's preemption service would install a handler
    # that only notes the signal, so a scheduler's preemption never ended a worker
    # (torch's default: SIGTERM ends it; jdist.checkpoint's save_on_preemption opts in
    # to save first).
    jax.config.update("jax_enable_preemption_service", False)
    seconds = max(1, int(timeout + 0.999))
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=spec.world_size,
            process_id=spec.rank,
            cluster_detection_method="deactivate",
            initialization_timeout=seconds,
            shutdown_timeout_seconds=min(seconds, 300),
            coordinator_bind_address=coordinator if spec.rank == 0 else None,
            local_device_ids=list(device_ids) if device_ids is not None else None,
        )
    except Exception as exc:
        raise RendezvousError(
            f"rank {spec.rank}: jax.distributed.initialize(coordinator={coordinator!r}, "
            f"num_processes={spec.world_size}) failed: {exc}"
        ) from exc
    return True


def _devices_by_rank(world_size: int) -> tuple[tuple[Any, ...], ...]:
    per: dict[int, list] = {r: [] for r in range(world_size)}
    for d in jax.devices():
        per.setdefault(d.process_index, []).append(d)
    if sorted(per) != list(range(world_size)) or any(not v for v in per.values()):
        raise RendezvousError(
            f"JAX sees devices of processes {sorted(per)} but the job has world_size "
            f"{world_size}; every process needs at least one device"
        )
    return tuple(tuple(sorted(per[r], key=lambda d: d.id)) for r in range(world_size))


def _make_world(rank: int, devices_per_rank, backend: str, timeout: float) -> ProcessGroup:
    flat = [d for ds in devices_per_rank for d in ds]
    return ProcessGroup(
        ranks=tuple(range(len(devices_per_rank))),
        rank=rank,
        mesh=make_mesh(flat, DEFAULT_AXIS),
        axis_name=DEFAULT_AXIS,
        backend=backend,
        devices_per_rank=tuple(devices_per_rank),
        name="WORLD",
        timeout=timeout,
        extra={"global_rank": rank},
    )


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       world_size: int = -1, rank: int = -1, timeout=None, store=None,
                       group_name: str = "", pg_options=None, device_id=None,
                       local_devices=None, stuck_timeout=None) -> None:
    """Start the default process group (torch's ``init_process_group``).

    Args:
      backend: ``"gloo"`` (CPU), ``"nccl"`` (GPU), torch's ``"cpu:gloo,cuda:nccl"``, or
        None to pick by JAX's platform.
      init_method: ``"env://"`` (default: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
        ``"tcp://host:port?rank=R&world_size=N"`` or ``"file:///path"``.
      world_size: number of processes (-1: from ``init_method``/environment; none at
        all means 1, the embedded single process).
      rank: this process's rank (-1: from ``init_method``/environment).
      timeout: seconds or ``timedelta`` for the rendezvous and for blocking calls on
        the group (default 30 minutes, as torch's gloo).
      store: a store to rendezvous through instead of ``init_method`` (needs explicit
        ``world_size`` and ``rank``).
      device_id: torch's one device bound to this process: an int index (or an object
        with ``.index``) means ``local_devices=[index]``.
      local_devices: the accelerators this process drives: ``"all"`` it sees, ``"one"``
        per process (the local rank's, as SLURM's ``--gpus-per-task=1`` implies), a
        count per process, or a list of ids; None reads ``JDIST_LOCAL_DEVICES``, then
        ``SLURM_GPUS_PER_TASK``, else all. CPU devices are not affected.
      stuck_timeout: seconds a collective or compiled step may wait for a rank that has
        not entered it before every rank exits, naming it (jdist's stuck-rank deadline,
        ``jdist/collectives/_stuck.py``); None reads ``JDIST_STUCK_TIMEOUT``, else off.
      group_name, pg_options: accepted for torch compatibility; unused.

    With ``init_method=None`` and no ``rank``/``world_size``, the job is detected from
    the environment: torchrun/jdist-run variables, Open MPI, SLURM (``srun``), PMI,
    a Kubernetes indexed Job, else one process; :func:`describe_job` says which and why.

    Raises:
      AlreadyInitializedError: called twice without ``destroy_process_group``.
      ValueError: bad arguments or a missing environment variable (named).
      RendezvousError: world sizes disagree, a rank is claimed twice, or JAX failed.
      RendezvousTimeoutError: ranks missing after ``timeout`` (named).
    """
    del group_name, pg_options
    if group_state.is_initialized():
        raise AlreadyInitializedError(
            "trying to initialize the default process group twice! (call "
            "jdist.destroy_process_group() first to start a new one)"
        )
    seconds = rdzv.parse_timeout(timeout)
    stuck = stuck_timeout_from(stuck_timeout, os.environ)
    requested = _check_backend(backend)
    spec = rdzv.parse_init(init_method, world_size, rank, store)
    job = rdzv.describe(init_method, world_size, rank, store, spec)
    if local_devices is None and device_id is not None:
        index = getattr(device_id, "index", device_id)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"device_id={device_id!r} must be a device index >= 0 (or None)")
        local_devices = [index]
    device_ids, why = local_device_ids(local_devices, job, os.environ)
    job = job._replace(devices=why)
    group_state.generation += 1
    if spec.world_size == 1:
        devices = (tuple(jax.local_devices()),)
        world = _make_world(0, devices, _platform_backend(requested), seconds)
        group_state.runtime = {"store": store, "watchdog": None, "jax": False,
                               "owns_store": False, "job": job}
        group_state.default_group = world
        return
    own_store, owns_jax = store is None, False
    if own_store:
        store = rdzv.make_store(spec, seconds)
    try:
        host = spec.host or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        deadline = time.monotonic() + seconds
        while True:
            try:
                res = rdzv.rendezvous(store, spec, max(deadline - time.monotonic(), 0.1),
                                      group_state.generation, host)
                break
            except StoreError as exc:
                # a client that reached the store of a job being torn down reconnects
                if (not own_store or spec.rank == 0 or isinstance(exc, TimeoutError)
                        or time.monotonic() > deadline):
                    raise
                _close_store(store)
                time.sleep(0.05)
                store = rdzv.make_store(spec, max(deadline - time.monotonic(), 0.1))
        owns_jax = _start_jax(spec, res.coordinator, seconds, device_ids)
        write_on_every_process()  # JAX writes cache entries on process 0 only
        world = _make_world(spec.rank, _devices_by_rank(spec.world_size),
                            _platform_backend(requested), seconds)
    except BaseException:
        if owns_jax and jax.distributed.is_initialized():
            _shutdown_jax({"jax": True})
        if own_store:
            _close_store(store)
        raise
    interval = float(os.environ.get("JDIST_HEARTBEAT_INTERVAL", "1.0"))
    hosted = 0 if own_store and spec.kind in ("env", "tcp") else None
    # the runtime's own connection: others (RPC) may block in get() on the shared one
    clone = getattr(store, "clone", None)
    watchdog = Watchdog(clone() if callable(clone) else store, spec.rank, res.infos,
                        group_state.generation, interval, store_host_rank=hosted,
                        stuck_timeout=stuck)
    watchdog.start()
    group_state.runtime = {"store": store, "watchdog": watchdog, "jax": owns_jax,
                           "owns_store": own_store, "spec": spec, "job": job}
    group_state.default_group = world
    _install_exit_teardown()


_EXIT = {"installed": False, "failed": False}
_EXIT_BYE_WAIT = 5.0


def _install_exit_teardown() -> None:
    """Destroy the group at interpreter exit (after JAX's own handler is registered,
    so this one runs first), unless the program is dying of an uncaught exception."""
    if _EXIT["installed"]:
        return
    _EXIT["installed"] = True
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        _EXIT["failed"] = True
        previous(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_teardown_at_exit)


def _teardown_at_exit() -> None:
    if _EXIT["failed"] or not group_state.is_initialized():
        return
    try:
        # short waits: a rank leaving through sys.exit(code) while its peers are stuck
        # in a collective must not hold up the launcher for long
        destroy_process_group(_at_exit=True)
    except Exception as exc:  # never turn a clean exit into a traceback
        print(f"jdist: teardown at exit failed: {exc!r}", file=sys.stderr)


def _close_store(store) -> None:
    for name in ("close", "shutdown"):
        fn = getattr(store, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:
                pass
            return


def _store_barrier(store, key: str, count: int, wait: float, arrive: bool = True) -> None:
    """Add one to ``key`` (when ``arrive``) and wait until it reaches ``count``.

    Best effort: teardown must not hang on a peer that is gone.
    """
    try:
        if arrive:
            store.add(key, 1)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if store.check([key]) and int(store.get(key)) >= count:
                return
            time.sleep(0.01)
    except Exception:
        pass


def _wait_server_gone(store, wait: float) -> None:
    """Block until rank 0 closed the TCPStore, so a re-init never reaches the old one."""
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            store.check(["jdist/closed"])
            time.sleep(0.01)
    except Exception:
        pass


def _shutdown_jax(rt: dict) -> None:
    if rt.get("jax"):
        try:
            jax.distributed.shutdown()
        except Exception:
            pass
        _clear_backends()


def destroy_process_group(group: ProcessGroup | None = None, *,
                          _at_exit: bool = False) -> None:
    """Tear down ``group``, or everything (the default group, JAX's runtime, the store).

    After the full teardown ``init_process_group`` may be called again. Destroying a
    sub-group only forgets it (its programs are dropped).

    Raises:
      NotInitializedError: nothing to destroy.
    """
    world = group_state.require("jdist.destroy_process_group()")
    if group is not None and group is not world:
        if group is NON_GROUP_MEMBER:
            return
        group.extra.clear()
        group_state.groups = [g for g in group_state.groups if g is not group]
        return
    rt = group_state.runtime
    queues = rt.get("queues")
    if queues is not None:
        queues.shutdown()
    watchdog = rt.get("watchdog")
    dead = dict(watchdog.dead) if watchdog is not None else {}
    if watchdog is not None:
        watchdog.stop()
        if watchdog.store is not rt.get("store"):
            _close_store(watchdog.store)
    for g in [world, *group_state.groups]:
        g.extra.clear()
    store, spec = rt.get("store"), rt.get("spec")
    gen, wait = group_state.generation, min(world.timeout, 30.0)
    if store is not None and spec is not None and not dead:
        # every rank is done with collectives before JAX's runtime goes away
        bye = min(wait, _EXIT_BYE_WAIT) if _at_exit else wait
        _store_barrier(store, f"jdist/bye/{gen}", spec.world_size, bye)
    host = spec is None or spec.rank == 0  # rank 0 hosts JAX's service (and the store)
    left = f"jdist/left/{gen}"
    if not host:
        _shutdown_jax(rt)
        if store is not None and not dead:
            _store_barrier(store, left, 0, 0.0)
            if rt.get("owns_store") and spec.kind in ("env", "tcp") and not _at_exit:
                _wait_server_gone(store, wait)
    else:
        if store is not None and spec is not None and not dead:
            # the clients disconnect from JAX's service and the store before it stops
            _store_barrier(store, left, spec.world_size - 1, wait, arrive=False)
        _shutdown_jax(rt)
    if store is not None and rt.get("owns_store"):
        _close_store(store)
    group_state.reset()


def describe_job() -> JobSpec:
    """The job of this process and how jdist found it.

    After :func:`init_process_group`, the job it used (with the devices it drives);
    before, what ``init_process_group()`` with no arguments would detect now. The result
    prints as a few lines (source, ranks, coordinator, job id, restart, devices, why);
    its fields (``source``, ``rank``, ``world_size``, ``local_rank``, ``master_addr``,
    ``master_port``, ``reason``, ...) are there for programs.

    Raises:
      ValueError: the environment is malformed (the variable and its value are quoted).
    """
    if group_state.is_initialized():
        job = group_state.runtime.get("job")
        if job is not None:
            return job
    job = detect_job()
    return job._replace(devices=local_device_ids(None, job, os.environ)[1])
