"""DataParallel for JAX/Flax: torch.nn.DataParallel's pieces and semantics, compiled.

``scatter``/``scatter_kwargs`` split a batch with ``torch.chunk`` sizes, ``replicate``
copies parameters (cached while unchanged), ``parallel_apply`` runs replicas
concurrently, ``gather`` concatenates their outputs; ``DataParallel`` and
``data_parallel`` compose them, running the replicas with equal chunks as ONE
``jit(shard_map)`` program over their sub-mesh (plus one program for an uneven last
chunk), with compiled programs and parameter copies cached across calls.

Differences from torch, on purpose:
  * inputs whose batch sizes differ raise ``ValueError`` (torch drops samples silently);
  * ``gather`` of strings/objects returns a list (torch: a ``map`` object), and dicts
    with other keys raise torch's error even when their counts agree;
  * replica ``i`` folds ``i`` into the module's PRNG keys (independent dropout masks);
  * gradients land where the parameters live (``device_ids[0]`` by default, as torch);
  * inside a user's ``jax.jit``/``vmap`` the replica semantics hold but are computed as a
    ``vmap`` over replicas, placed by the outer ``jit`` (eager calls place on devices).
"""

from jdist.dp._data_parallel import DataParallel as DataParallel
from jdist.dp._data_parallel import data_parallel as data_parallel
from jdist.dp._parallel_apply import parallel_apply as parallel_apply
from jdist.dp._replicate import ReplicaCache as ReplicaCache
from jdist.dp._replicate import replicate as replicate
from jdist.dp._scatter_gather import chunk_sizes as chunk_sizes
from jdist.dp._scatter_gather import gather as gather
from jdist.dp._scatter_gather import scatter as scatter
from jdist.dp._scatter_gather import scatter_kwargs as scatter_kwargs

__all__ = [
    "DataParallel",
    "data_parallel",
    "scatter",
    "scatter_kwargs",
    "replicate",
    "parallel_apply",
    "gather",
    "chunk_sizes",
    "ReplicaCache",
]
