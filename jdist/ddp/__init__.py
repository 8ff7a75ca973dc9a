"""jdist.ddp: torch's DistributedDataParallel for Flax (NNX modules, Linen, pytrees).

Gradients are reduced bucket by bucket from inside the backward pass of one jitted
``shard_map`` program per step; see ``DistributedDataParallel`` and ``FunctionalDDP``.
"""

from jdist.ddp import hooks as hooks
from jdist.ddp._buckets import DEFAULT_BUCKET_CAP_MB as DEFAULT_BUCKET_CAP_MB
from jdist.ddp._buckets import DEFAULT_FIRST_BUCKET_BYTES as DEFAULT_FIRST_BUCKET_BYTES
from jdist.ddp._buckets import MB_TO_BYTES as MB_TO_BYTES
from jdist.ddp._buckets import Bucket as Bucket
from jdist.ddp._buckets import BucketCapacityConfig as BucketCapacityConfig
from jdist.ddp._buckets import BucketLayout as BucketLayout
from jdist.ddp._buckets import (
    compute_bucket_assignment_by_size as compute_bucket_assignment_by_size,
)
from jdist.ddp._ddp import DistributedDataParallel as DistributedDataParallel
from jdist.ddp._functional import FunctionalDDP as FunctionalDDP
from jdist.ddp._join import Join as Join
from jdist.ddp._syncbn import SyncBatchNorm as SyncBatchNorm
from jdist.ddp._syncbn import convert_sync_batchnorm as convert_sync_batchnorm
from jdist.ddp.hooks._base import CommHook as CommHook
from jdist.ddp.hooks._base import GradBucket as GradBucket

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "MB_TO_BYTES",
    "Bucket",
    "BucketCapacityConfig",
    "BucketLayout",
    "CommHook",
    "DistributedDataParallel",
    "FunctionalDDP",
    "Join",
    "convert_sync_batchnorm",
    "SyncBatchNorm",
    "GradBucket",
    "compute_bucket_assignment_by_size",
    "hooks",
]
