"""Distributed optimizers (``jdist.optim``): Horovod's all-reduce wrapper and ZeRO-1.

Both are optax-style transformations used inside ``shard_map`` over the group's axis.

``AllReduceOptimizer`` (alias ``DistributedOptimizer``, Horovod's name) all-reduces the
gradients, then steps. It is NOT torch's ``torch.distributed.optim.DistributedOptimizer``:
that one, which steps RRef-held parameters with a distributed-autograd context's
gradients, is :class:`jdist.rpc.DistributedOptimizer`.

``ParamGroups`` gives any optax factory torch's parameter groups (per-group
hyperparameters kept in the state, ``add_param_group``); ``ZeroRedundancyOptimizer``
takes it as ``tx`` and is a ``jdist.algorithms.join.Joinable``.
"""

from jdist.optim._broadcast import broadcast_optimizer_state as broadcast_optimizer_state
from jdist.optim._broadcast import broadcast_parameters as broadcast_parameters
from jdist.optim._compression import Compression as Compression
from jdist.optim._compression import Compressor as Compressor
from jdist.optim._distributed import AllReduceOptimizer as AllReduceOptimizer
from jdist.optim._distributed import DistributedOptimizer as DistributedOptimizer
from jdist.optim._distributed import DistributedOptimizerState as DistributedOptimizerState
from jdist.optim._distributed import fused_allreduce as fused_allreduce
from jdist.optim._param_groups import ParamGroups as ParamGroups
from jdist.optim._param_groups import ParamGroupsState as ParamGroupsState
from jdist.optim._param_groups import param_groups as param_groups
from jdist.optim._param_groups import set_hyperparams as set_hyperparams
from jdist.optim._zero import ZeroRedundancyOptimizer as ZeroRedundancyOptimizer
from jdist.optim._zero import ZeroState as ZeroState
from jdist.optim._zero import flat_partition as flat_partition
from jdist.optim._zero_replay import NonSeparableTransformError as NonSeparableTransformError

__all__ = [
    "AllReduceOptimizer",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "DistributedOptimizerState",
    "NonSeparableTransformError",
    "ParamGroups",
    "ParamGroupsState",
    "ZeroRedundancyOptimizer",
    "ZeroState",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "flat_partition",
    "fused_allreduce",
    "param_groups",
    "set_hyperparams",
]
