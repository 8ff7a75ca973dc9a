"""Process groups, stores, and c10d-style collectives (eager and in-graph).

Owners of each private module add their public names here, one import per line.
"""

from jdist.collectives import functional as functional
from jdist.collectives._alltoall import all_to_all as all_to_all
from jdist.collectives._alltoall import all_to_all_single as all_to_all_single
from jdist.collectives._barrier import barrier as barrier
from jdist.collectives._coalesced import all_reduce_coalesced as all_reduce_coalesced
from jdist.collectives._coalesced import broadcast_coalesced as broadcast_coalesced
from jdist.collectives._eager import all_gather as all_gather
from jdist.collectives._eager import all_gather_into_tensor as all_gather_into_tensor
from jdist.collectives._eager import all_gather_single as all_gather_single
from jdist.collectives._eager import all_reduce as all_reduce
from jdist.collectives._eager import broadcast as broadcast
from jdist.collectives._eager import gather as gather
from jdist.collectives._eager import reduce as reduce
from jdist.collectives._eager import reduce_scatter as reduce_scatter
from jdist.collectives._eager import reduce_scatter_single as reduce_scatter_single
from jdist.collectives._eager import reduce_scatter_tensor as reduce_scatter_tensor
from jdist.collectives._eager import scatter as scatter
from jdist.collectives._flat import all_reduce_flat as all_reduce_flat
from jdist.collectives._flat import invariant_leaves as invariant_leaves
from jdist.collectives._flat import prefers_flat as prefers_flat
from jdist.collectives._group import NON_GROUP_MEMBER as NON_GROUP_MEMBER
from jdist.collectives._group import ProcessGroup as ProcessGroup
from jdist.collectives._group import get_backend as get_backend
from jdist.collectives._group import get_default_group as get_default_group
from jdist.collectives._group import get_global_rank as get_global_rank
from jdist.collectives._group import get_group_rank as get_group_rank
from jdist.collectives._group import get_process_group_ranks as get_process_group_ranks
from jdist.collectives._group import get_rank as get_rank
from jdist.collectives._group import get_world_size as get_world_size
from jdist.collectives._group import is_initialized as is_initialized
from jdist.collectives._group import new_group as new_group
from jdist.collectives._init import describe_job as describe_job
from jdist.collectives._init import destroy_process_group as destroy_process_group
from jdist.collectives._init import init_process_group as init_process_group
from jdist.collectives._launched import is_torchelastic_launched as is_torchelastic_launched
from jdist.collectives._monitored import monitored_barrier as monitored_barrier
from jdist.collectives._object import all_gather_object as all_gather_object
from jdist.collectives._object import broadcast_object_list as broadcast_object_list
from jdist.collectives._object import gather_object as gather_object
from jdist.collectives._object import scatter_object_list as scatter_object_list
from jdist.collectives._p2p import P2POp as P2POp
from jdist.collectives._p2p import batch_isend_irecv as batch_isend_irecv
from jdist.collectives._p2p import irecv as irecv
from jdist.collectives._p2p import isend as isend
from jdist.collectives._p2p import recv as recv
from jdist.collectives._p2p import send as send
from jdist.collectives._replicate import place_replicated as place_replicated
from jdist.collectives._types import ReduceOp as ReduceOp
from jdist.collectives._work import Work as Work
from jdist.store import FileStore as FileStore
from jdist.store import HashStore as HashStore
from jdist.store import PrefixStore as PrefixStore
from jdist.store import Store as Store
from jdist.store import TCPStore as TCPStore

__all__ = [
    "functional",
    "is_torchelastic_launched",
    "NON_GROUP_MEMBER",
    "ProcessGroup",
    "ReduceOp",
    "all_reduce",
    "all_reduce_flat",
    "prefers_flat",
    "invariant_leaves",
    "broadcast",
    "all_reduce_coalesced",
    "broadcast_coalesced",
    "place_replicated",
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
    "Store",
    "TCPStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
]
