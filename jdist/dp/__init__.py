"""DataParallel for JAX/Flax: torch.nn.DataParallel's pieces and semantics, compiled.

``scatter``/``scatter_kwargs`` split a batch with ``torch.chunk`` sizes, ``replicate``
copies parameters (cached while unchanged), ``parallel_apply`` runs replicas
concurrently, ``gather`` concatenates their outputs; ``DataParallel`` and
``data_parallel`` compose them, running equal chunks as one SPMD program.
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
