"""Process groups, stores, and c10d-style collectives (eager and in-graph).

Owners of each private module add their public names here, one import per line.
"""

from jdist.collectives import functional as functional
from jdist.collectives._group import NON_GROUP_MEMBER as NON_GROUP_MEMBER
from jdist.collectives._group import ProcessGroup as ProcessGroup
from jdist.collectives._types import ReduceOp as ReduceOp

__all__ = [
    "functional",
    "NON_GROUP_MEMBER",
    "ProcessGroup",
    "ReduceOp",
]
