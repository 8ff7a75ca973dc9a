"""jdist: PyTorch's distributed training semantics on JAX, Flax and Optax.

Process groups and collectives are re-exported here (as ``torch.distributed`` does);
subpackages (``jdist.ddp``, ``jdist.dp``, ``jdist.sampler``, ``jdist.optim``,
``jdist.rpc``, ``jdist.launch``, ``jdist.testing``) load on first use.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

from jdist import errors as errors
from jdist.collectives import NON_GROUP_MEMBER as NON_GROUP_MEMBER
from jdist.collectives import ProcessGroup as ProcessGroup
from jdist.collectives import ReduceOp as ReduceOp

try:
    __version__ = version("jdist")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

_SUBPACKAGES = ("collectives", "ddp", "dp", "launch", "optim", "rpc", "sampler", "testing")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"jdist.{name}")
    raise AttributeError(f"module 'jdist' has no attribute {name!r}")


__all__ = [
    "NON_GROUP_MEMBER",
    "ProcessGroup",
    "ReduceOp",
    "errors",
    "__version__",
]
