"""Cross-framework tools for checking a JAX/Flax port against PyTorch.

Weight conversion between torch modules and Flax NNX modules (both directions, paired
by layer definition order; see :mod:`jdist.testing._convert` for the rule and for what
the user must keep consistent: layouts, epsilons, BatchNorm momentum). Flax lacks exact
counterparts of some torch layers; :class:`EmbeddingBag`, :class:`LSTM`, :class:`GRU`
and :class:`TransformerEncoderLayer` are NNX modules holding torch's arrays exactly.

Parity harness: :func:`run_parity` trains a torch model and its NNX port side by side
and returns a :class:`ParityReport` (per-step losses, per-layer parameter differences);
``python -m jdist.testing.parity`` runs built-in pairs (see :mod:`jdist.testing._parity`).

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
from jdist.testing._convert_rnn import GRU as GRU
from jdist.testing._convert_rnn import LSTM as LSTM
from jdist.testing._convert_transformer import TransformerEncoderLayer as TransformerEncoderLayer
from jdist.testing._embedding_bag import EmbeddingBag as EmbeddingBag
from jdist.testing._parity import run_parity as run_parity
from jdist.testing._parity import run_parity_cases as run_parity_cases
from jdist.testing._parity_case import Case as Case
from jdist.testing._parity_case import batch_schedule as batch_schedule
from jdist.testing._parity_models import TorchBatchNorm as TorchBatchNorm
from jdist.testing._parity_pairs import LOSSES as LOSSES
from jdist.testing._parity_pairs import OPTIMIZERS as OPTIMIZERS
from jdist.testing._parity_pairs import LossPair as LossPair
from jdist.testing._parity_pairs import OptimizerSpec as OptimizerSpec
from jdist.testing._parity_pairs import loss_pair as loss_pair
from jdist.testing._parity_pairs import make_optax as make_optax
from jdist.testing._parity_pairs import make_torch_optimizer as make_torch_optimizer
from jdist.testing._parity_pairs import optimizer_spec as optimizer_spec
from jdist.testing._parity_report import ArrayDiff as ArrayDiff
from jdist.testing._parity_report import ParityReport as ParityReport
from jdist.testing._parity_report import StepResult as StepResult
from jdist.testing._parity_report import compare_models as compare_models

__all__ = [
    "EmbeddingBag",
    "GRU",
    "LSTM",
    "TransformerEncoderLayer",
    "flax_to_torch_momentum",
    "nnx_state_to_torch_state_dict",
    "nnx_to_torch",
    "paired_layers",
    "state_dict_to_nnx",
    "torch_to_flax_momentum",
    "torch_to_nnx",
    # parity harness
    "LOSSES",
    "OPTIMIZERS",
    "ArrayDiff",
    "Case",
    "LossPair",
    "OptimizerSpec",
    "ParityReport",
    "StepResult",
    "TorchBatchNorm",
    "batch_schedule",
    "compare_models",
    "loss_pair",
    "make_optax",
    "make_torch_optimizer",
    "optimizer_spec",
    "run_parity",
    "run_parity_cases",
]
