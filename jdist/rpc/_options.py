"""``RpcBackendOptions``: thread pool, timeouts, secret, frame cap, transport."""

from __future__ import annotations

import dataclasses
import enum
import os

__all__ = ["RpcBackendOptions", "BackendType", "DEFAULT_RPC_TIMEOUT", "UNSET_RPC_TIMEOUT",
           "resolve_timeout"]


class BackendType(enum.Enum):
    """torch's ``rpc.BackendType``: jdist has one backend, named as torch's default."""

    TENSORPIPE = "TENSORPIPE"

DEFAULT_RPC_TIMEOUT = 60.0
UNSET_RPC_TIMEOUT = -1.0


@dataclasses.dataclass
class RpcBackendOptions:
    """Options of the RPC agent (torch's ``TensorPipeRpcBackendOptions`` plus security).

    Attributes:
      init_method: where workers meet: ``"env://"`` (MASTER_ADDR/MASTER_PORT, rank 0
        hosts a TCPStore there), ``"tcp://host:port"``, or a store object.
      rpc_timeout: default seconds per RPC (``timeout=-1`` calls use it; 0 = none).
      num_worker_threads: threads that run incoming calls.
      auth_token: shared secret of the job; ``None`` reads ``JDIST_AUTH_TOKEN``
        (``jdist-run`` sets one per job).
      max_frame_bytes: largest message accepted from a peer; bigger ones are refused and
        the connection closed.
      listen_address: interface to listen on (default ``127.0.0.1``: loopback only; give
        a routable address for multi-host jobs).
      transport: ``"tcp"`` or ``"inproc"`` (in-process agents, for tests).
      connect_timeout: seconds to connect and authenticate to a peer.
      shutdown_timeout: how long ``shutdown(graceful=True)`` keeps waiting for a worker
        that has not called ``shutdown`` yet and stopped answering pings (a busy worker
        that answers is waited for without limit, as torch does).
      rendezvous_timeout: seconds ``init_rpc`` waits for every worker to arrive (not
        ``rpc_timeout``: a short per-call timeout must not fail the start-up).
      device_maps, devices: torch's CUDA device maps; only ``None`` or empty (jdist
        sends arrays through host memory and puts them on the receiver's default
        device: move them with ``jax.device_put`` after they arrive).
      busy_poll_us: microseconds a thread about to wait for a message (a caller for its
        reply, a pool thread for the next call) reads its connection itself first, so a
        message that comes soon wakes no thread (each wake-up of an idle CPU costs tens
        of microseconds). It holds the GIL between reads, so it is skipped while other
        threads of the process run RPC functions and for peers in this process; other
        Python threads of the process can be delayed by up to this much per wait.
        Waits of a kind whose messages have taken longer than three windows on average
        (a reply from a function that computes for a millisecond) skip the poll.
        0 turns polling off.
      busy_poll_max_us: the longest such poll where this machine has a usable core for
        each of the job's RPC processes on it (peers at the same host in the worker
        table, this one included): there a kind of wait whose messages come within
        half of this on average polls for twice its average, so a reply to a function
        that computes for a millisecond wakes no thread either (torch's RPC threads
        spin too). With more processes than cores the poll stays at ``busy_poll_us``
        (spinning would take the core a peer computes on; see docs/design-rpc.md).
        Other Python threads of the process may wait up to this long per wait, as
        with ``busy_poll_us``. Set it to ``busy_poll_us`` to never poll longer.
    """

    init_method: object = "env://"
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    num_worker_threads: int = 16
    auth_token: str | bytes | None = None
    max_frame_bytes: int = 1 << 31
    listen_address: str | None = None
    transport: str = "tcp"
    connect_timeout: float = 10.0
    shutdown_timeout: float = 60.0
    busy_poll_us: float = 200.0
    busy_poll_max_us: float = 4000.0
    rendezvous_timeout: float = 300.0
    device_maps: dict | None = None
    devices: list | None = None

    def __post_init__(self) -> None:
        if self.device_maps or self.devices:
            _no_device_maps(self.device_maps or self.devices)
        if not isinstance(self.rpc_timeout, (int, float)) or self.rpc_timeout < 0:
            raise ValueError(f"rpc_timeout must be seconds >= 0 (0 = no timeout), "
                             f"got {self.rpc_timeout!r}")
        if not isinstance(self.num_worker_threads, int) or self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be an int >= 1, "
                             f"got {self.num_worker_threads!r}")
        if not isinstance(self.max_frame_bytes, int) or self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be an int >= 1024, "
                             f"got {self.max_frame_bytes!r}")
        if self.transport not in ("tcp", "inproc"):
            from jdist.rpc.transport import transport_schemes

            if self.transport not in transport_schemes():
                raise ValueError(f"transport must be one of {transport_schemes()}, "
                                 f"got {self.transport!r}")
        if self.auth_token is not None and not isinstance(self.auth_token, (str, bytes)):
            raise TypeError(f"auth_token must be str or bytes, got {type(self.auth_token)}")
        for field in ("busy_poll_us", "busy_poll_max_us"):
            v = getattr(self, field)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1e6:
                raise ValueError(f"{field} must be microseconds in 0..1e6 (busy_poll_us=0: "
                                 f"no polling), got {v!r}")
        for field in ("connect_timeout", "shutdown_timeout", "rendezvous_timeout"):
            v = getattr(self, field)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{field} must be seconds > 0, got {v!r}")

    def set_device_map(self, to: str, device_map: dict) -> None:
        """torch's device map setter: refused (see ``device_maps``).

        Raises:
          ValueError: always, naming what to do instead.
        """
        _no_device_maps({to: device_map})

    def set_devices(self, devices: list) -> None:
        """torch's device list setter: refused (see ``device_maps``)."""
        _no_device_maps(devices)

    def auth_key(self) -> bytes | None:
        """The secret as bytes (``auth_token`` or ``JDIST_AUTH_TOKEN``), or None."""
        token = self.auth_token if self.auth_token is not None else os.environ.get(
            "JDIST_AUTH_TOKEN")
        if token is None or token == "":
            return None
        return token.encode() if isinstance(token, str) else bytes(token)

    def listen_on(self) -> str:
        """The transport address to listen on (any free port / fresh name)."""
        if self.transport == "inproc":
            return "inproc://"
        host = self.listen_address or "127.0.0.1"
        if "://" in host:
            return host
        return f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"


def _no_device_maps(value: object) -> None:
    raise ValueError(f"jdist.rpc has no device maps (got {value!r}): arrays travel through "
                     "host memory and arrive on the receiver's default JAX device; move "
                     "them with jax.device_put after they arrive (a departure from torch's "
                     "TensorPipe CUDA maps)")


def resolve_timeout(timeout: float | None, default: float) -> float | None:
    """torch's convention: -1 (or None) = ``default``, 0 = none (returns None).

    Raises:
      ValueError: a negative timeout other than -1.
    """
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        timeout = default
    if not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout must be seconds >= 0, 0 for none, or -1 for the default "
                         f"rpc_timeout, got {timeout!r}")
    return None if timeout == 0 else float(timeout)
