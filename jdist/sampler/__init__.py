"""jdist.sampler: torch's ``DistributedSampler``, index for index, without torch.

``DistributedSampler`` yields exactly the indices torch's sampler yields (the shuffle
reproduces ``torch.randperm`` bit for bit, in vectorized numpy), and adds mid-epoch
resume (``state_dict``), exact evaluation (``even_split=False``) and a warning when
``set_epoch`` is forgotten. ``shard_indices`` is the same maths as a pure function,
``shard_sequence`` and ``ShardedSampler`` shard any sampler's output, and ``batches``
turns a sampler plus in-memory arrays into prefetched device batches.

Feeding real data (docs/data.md): ``ResumableLoader`` wraps a torch ``DataLoader`` (or
any loader in a jdist sampler's order) with exact mid-epoch resume and device prefetch;
``numpy_collate`` / ``to_numpy`` keep batches numpy; ``ArrayLoader`` reads batches from
memory-mapped arrays larger than memory; ``GrainSampler``, ``grain_dataset`` and
``grain_loader`` give grain torch's order (grain is optional and imported lazily).
"""

from jdist.sampler._arrays import ArrayLoader as ArrayLoader
from jdist.sampler._collate import numpy_collate as numpy_collate
from jdist.sampler._collate import to_numpy as to_numpy
from jdist.sampler._grain import GrainSampler as GrainSampler
from jdist.sampler._grain import grain_dataset as grain_dataset
from jdist.sampler._grain import grain_loader as grain_loader
from jdist.sampler._indices import epoch_order as epoch_order
from jdist.sampler._indices import num_samples as num_samples
from jdist.sampler._indices import shard_indices as shard_indices
from jdist.sampler._indices import shard_sequence as shard_sequence
from jdist.sampler._loader import batches as batches
from jdist.sampler._place import batch_sharding as batch_sharding
from jdist.sampler._randperm import TORCH_SWAP_LIMIT as TORCH_SWAP_LIMIT
from jdist.sampler._randperm import randperm as randperm
from jdist.sampler._resumable import ResumableLoader as ResumableLoader
from jdist.sampler._sampler import DistributedSampler as DistributedSampler
from jdist.sampler._sampler import RepeatedEpochWarning as RepeatedEpochWarning
from jdist.sampler._sharded import ShardedSampler as ShardedSampler

__all__ = [
    "ArrayLoader",
    "DistributedSampler",
    "GrainSampler",
    "RepeatedEpochWarning",
    "ResumableLoader",
    "ShardedSampler",
    "TORCH_SWAP_LIMIT",
    "batch_sharding",
    "batches",
    "epoch_order",
    "grain_dataset",
    "grain_loader",
    "num_samples",
    "numpy_collate",
    "randperm",
    "shard_indices",
    "shard_sequence",
    "to_numpy",
]
