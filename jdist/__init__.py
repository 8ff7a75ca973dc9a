"""jdist: PyTorch's distributed training semantics on JAX, Flax and Optax.

Process groups and collectives are re-exported here (as ``torch.distributed`` does);
they and the subpackages (``jdist.ddp``, ``jdist.dp``, ``jdist.sampler``, ``jdist.optim``,
``jdist.rpc``, ``jdist.launch``, ``jdist.store``, ``jdist.checkpoint``, ``jdist.testing``,
``jdist.algorithms``)
load on first use, so ``import jdist`` stays cheap and the launcher never imports JAX.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from jdist import errors as errors

if TYPE_CHECKING:  # explicit re-exports for type checkers; loaded lazily at run time
    from jdist.collectives import NON_GROUP_MEMBER as NON_GROUP_MEMBER
    from jdist.collectives import P2POp as P2POp
    from jdist.collectives import ProcessGroup as ProcessGroup
    from jdist.collectives import ReduceOp as ReduceOp
    from jdist.collectives import Work as Work
    from jdist.collectives import all_gather as all_gather
    from jdist.collectives import all_gather_into_tensor as all_gather_into_tensor
    from jdist.collectives import all_gather_object as all_gather_object
    from jdist.collectives import all_gather_single as all_gather_single
    from jdist.collectives import all_reduce as all_reduce
    from jdist.collectives import all_to_all as all_to_all
    from jdist.collectives import all_to_all_single as all_to_all_single
    from jdist.collectives import barrier as barrier
    from jdist.collectives import batch_isend_irecv as batch_isend_irecv
    from jdist.collectives import broadcast as broadcast
    from jdist.collectives import broadcast_object_list as broadcast_object_list
    from jdist.collectives import describe_job as describe_job
    from jdist.collectives import destroy_process_group as destroy_process_group
    from jdist.collectives import gather as gather
    from jdist.collectives import gather_object as gather_object
    from jdist.collectives import get_backend as get_backend
    from jdist.collectives import get_default_group as get_default_group
    from jdist.collectives import get_global_rank as get_global_rank
    from jdist.collectives import get_group_rank as get_group_rank
    from jdist.collectives import get_process_group_ranks as get_process_group_ranks
    from jdist.collectives import get_rank as get_rank
    from jdist.collectives import get_world_size as get_world_size
    from jdist.collectives import init_process_group as init_process_group
    from jdist.collectives import irecv as irecv
    from jdist.collectives import is_initialized as is_initialized
    from jdist.collectives import is_torchelastic_launched as is_torchelastic_launched
    from jdist.collectives import isend as isend
    from jdist.collectives import monitored_barrier as monitored_barrier
    from jdist.collectives import new_group as new_group
    from jdist.collectives import recv as recv
    from jdist.collectives import reduce as reduce
    from jdist.collectives import reduce_scatter as reduce_scatter
    from jdist.collectives import reduce_scatter_single as reduce_scatter_single
    from jdist.collectives import reduce_scatter_tensor as reduce_scatter_tensor
    from jdist.collectives import scatter as scatter
    from jdist.collectives import scatter_object_list as scatter_object_list
    from jdist.collectives import send as send
    from jdist.store import FileStore as FileStore
    from jdist.store import HashStore as HashStore
    from jdist.store import PrefixStore as PrefixStore
    from jdist.store import Store as Store
    from jdist.store import TCPStore as TCPStore

# Loaded on first use, so that `import jdist` (and the jdist-run launcher) does not
# import JAX until a collective name is touched; the store names come from the
# JAX-free jdist.store. One table: __all__ and the TYPE_CHECKING block above list the
# same names (tests/test_public_api.py checks it).
_LAZY: dict[str, tuple[str, ...]] = {
    "jdist.store": ("FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"),
    "jdist.collectives": (
        "NON_GROUP_MEMBER", "P2POp", "ProcessGroup", "ReduceOp", "Work", "all_gather",
        "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_reduce",
        "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
        "broadcast_object_list", "describe_job", "destroy_process_group", "gather",
        "gather_object", "get_backend",
        "get_default_group", "get_global_rank", "get_group_rank", "get_process_group_ranks",
        "get_rank", "get_world_size", "init_process_group", "irecv", "is_initialized",
        "is_torchelastic_launched", "isend",
        "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter",
        "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
    ),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

try:
    __version__ = version("jdist")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

_SUBPACKAGES = ("algorithms", "checkpoint", "collectives", "ddp", "dp", "launch", "optim", "rpc",
                "sampler", "store", "testing")


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"jdist.{name}")
    raise AttributeError(f"module 'jdist' has no attribute {name!r}")


__all__ = [
    "Store",
    "TCPStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "NON_GROUP_MEMBER",
    "ProcessGroup",
    "ReduceOp",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
    "is_initialized",
    "is_torchelastic_launched",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "new_group",
    "init_process_group",
    "destroy_process_group",
    "describe_job",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "batch_isend_irecv",
    "all_to_all_single",
    "all_gather_single",
    "reduce_scatter_single",
    "Work",
    "errors",
    "__version__",
]
