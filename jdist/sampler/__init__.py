"""jdist.sampler: torch's ``DistributedSampler``, index for index, without torch.

``DistributedSampler`` yields exactly the indices torch's sampler yields (the shuffle
reproduces ``torch.randperm`` bit for bit, in vectorized numpy), and adds mid-epoch
resume (``state_dict``), exact evaluation (``even_split=False``) and a warning when
``set_epoch`` is forgotten. ``shard_indices`` is the same maths as a pure function,
``shard_sequence`` and ``ShardedSampler`` shard any sampler's output, and ``batches``
turns a sampler plus in-memory arrays into prefetched device batches.
"""

from jdist.sampler._indices import epoch_order as epoch_order
from jdist.sampler._indices import num_samples as num_samples
from jdist.sampler._indices import shard_indices as shard_indices
from jdist.sampler._indices import shard_sequence as shard_sequence
from jdist.sampler._loader import batches as batches
from jdist.sampler._randperm import TORCH_SWAP_LIMIT as TORCH_SWAP_LIMIT
from jdist.sampler._randperm import randperm as randperm
from jdist.sampler._sampler import DistributedSampler as DistributedSampler
from jdist.sampler._sampler import RepeatedEpochWarning as RepeatedEpochWarning
from jdist.sampler._sharded import ShardedSampler as ShardedSampler

__all__ = [
    "DistributedSampler",
    "RepeatedEpochWarning",
    "ShardedSampler",
    "TORCH_SWAP_LIMIT",
    "batches",
    "epoch_order",
    "num_samples",
    "randperm",
    "shard_indices",
    "shard_sequence",
]
