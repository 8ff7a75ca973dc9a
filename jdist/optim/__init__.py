"""Distributed optimizers (``jdist.optim``): Horovod's all-reduce wrapper and ZeRO-1.

Both are optax-style transformations used inside ``shard_map`` over the group's axis.
"""

from jdist.optim._compression import Compression as Compression
from jdist.optim._compression import Compressor as Compressor
from jdist.optim._distributed import DistributedOptimizer as DistributedOptimizer
from jdist.optim._distributed import DistributedOptimizerState as DistributedOptimizerState
from jdist.optim._distributed import fused_allreduce as fused_allreduce
from jdist.optim._zero import ZeroRedundancyOptimizer as ZeroRedundancyOptimizer
from jdist.optim._zero import ZeroState as ZeroState
from jdist.optim._zero import flat_partition as flat_partition

__all__ = [
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "DistributedOptimizerState",
    "ZeroRedundancyOptimizer",
    "ZeroState",
    "flat_partition",
    "fused_allreduce",
]
