"""Cross-framework tools for checking a JAX/Flax port against PyTorch.

Weight conversion between torch modules and Flax NNX modules (both directions, paired
by layer definition order; see :mod:`jdist.testing._convert` for the rule and for what
the user must keep consistent: layouts, epsilons, BatchNorm momentum).

torch is a test oracle only: it is imported lazily inside the functions that use it,
never by ``import jdist.testing``.
"""

from jdist.testing._convert import flax_to_torch_momentum as flax_to_torch_momentum
from jdist.testing._convert import nnx_state_to_torch_state_dict as nnx_state_to_torch_state_dict
from jdist.testing._convert import nnx_to_torch as nnx_to_torch
from jdist.testing._convert import paired_layers as paired_layers
from jdist.testing._convert import state_dict_to_nnx as state_dict_to_nnx
from jdist.testing._convert import torch_to_flax_momentum as torch_to_flax_momentum
from jdist.testing._convert import torch_to_nnx as torch_to_nnx

__all__ = [
    "flax_to_torch_momentum",
    "nnx_state_to_torch_state_dict",
    "nnx_to_torch",
    "paired_layers",
    "state_dict_to_nnx",
    "torch_to_flax_momentum",
    "torch_to_nnx",
]
