"""jdist.rpc: torch.distributed.rpc's API over authenticated asyncio sockets.

``init_rpc`` starts a worker; ``rpc_sync`` / ``rpc_async`` / ``remote`` run functions on
other workers; :class:`RRef` names remote values (reference counted across workers);
``shutdown`` ends it. See ``docs/design-rpc.md`` for the message flow.
"""

from jdist.rpc import functions as functions
from jdist.rpc._api import get_rpc_timeout as get_rpc_timeout
from jdist.rpc._api import get_worker_info as get_worker_info
from jdist.rpc._api import init_rpc as init_rpc
from jdist.rpc._api import remote as remote
from jdist.rpc._api import rpc_async as rpc_async
from jdist.rpc._api import rpc_sync as rpc_sync
from jdist.rpc._api import shutdown as shutdown
from jdist.rpc._buckets import next_bucket as next_bucket
from jdist.rpc._futures import Future as Future
from jdist.rpc._futures import collect_all as collect_all
from jdist.rpc._futures import wait_all as wait_all
from jdist.rpc._options import BackendType as BackendType
from jdist.rpc._options import RpcBackendOptions as RpcBackendOptions
from jdist.rpc._protocol import WorkerInfo as WorkerInfo
from jdist.rpc._rref import RRef as RRef

TensorPipeRpcBackendOptions = RpcBackendOptions  # the name torch users have in their code

# distributed autograd pulls in jax, flax and optax: imported on first use
_LAZY = {"dist_autograd": ("jdist.rpc.dist_autograd", None),
         "DistributedOptimizer": ("jdist.rpc._dist_optim", "DistributedOptimizer"),
         "RemoteModule": ("jdist.rpc._remote_module", "RemoteModule")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jdist.rpc' has no attribute {name!r}")

__all__ = [
    "BackendType",
    "DistributedOptimizer",
    "Future",
    "RemoteModule",
    "RRef",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "collect_all",
    "dist_autograd",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "next_bucket",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "wait_all",
]
