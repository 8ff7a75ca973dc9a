"""torch's ``DDPCommHookType`` and ``register_ddp_comm_hook``: built-in hooks by name.

``register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, ddp, state=group)`` registers
:func:`fp16_compress_hook` with ``state``; the PowerSGD types wrap ``state`` (a process
group or ``None``) in a :class:`PowerSGDState` of rank 1 or 2 with
``start_powerSGD_iter=1_000``, as torch's wrapper does. torch's ``NOOP`` type is not
offered: a hook that leaves each replica its own gradients cannot keep DDP's one
replicated copy of the parameters (DDP raises ``ReplicaDivergenceError`` for it).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from jdist.ddp.hooks._default import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from jdist.ddp.hooks._powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from jdist.ddp.hooks._quantization import (
    quantization_perchannel_hook,
    quantization_pertensor_hook,
)

__all__ = ["DDPCommHookType", "register_ddp_comm_hook"]


class DDPCommHookType(Enum):
    """The built-in comm hooks by torch's names."""

    ALLREDUCE = "allreduce"
    FP16_COMPRESS = "fp16_compress"
    BF16_COMPRESS = "bf16_compress"
    QUANTIZE_PER_TENSOR = "quantize_per_tensor"
    QUANTIZE_PER_CHANNEL = "quantize_per_channel"
    POWER_SGD = "power_sgd"
    POWER_SGD_RANK2 = "power_sgd_rank2"
    BATCHED_POWER_SGD = "batched_power_sgd"
    BATCHED_POWER_SGD_RANK2 = "batched_power_sgd_rank2"


# type -> (hook, PowerSGD rank or None)
_HOOKS = {
    DDPCommHookType.ALLREDUCE: (allreduce_hook, None),
    DDPCommHookType.FP16_COMPRESS: (fp16_compress_hook, None),
    DDPCommHookType.BF16_COMPRESS: (bf16_compress_hook, None),
    DDPCommHookType.QUANTIZE_PER_TENSOR: (quantization_pertensor_hook, None),
    DDPCommHookType.QUANTIZE_PER_CHANNEL: (quantization_perchannel_hook, None),
    DDPCommHookType.POWER_SGD: (powerSGD_hook, 1),
    DDPCommHookType.POWER_SGD_RANK2: (powerSGD_hook, 2),
    DDPCommHookType.BATCHED_POWER_SGD: (batched_powerSGD_hook, 1),
    DDPCommHookType.BATCHED_POWER_SGD_RANK2: (batched_powerSGD_hook, 2),
}


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model: Any,
                           state: Any = None) -> None:
    """Register the built-in hook ``comm_hook_type`` on the DDP wrapper ``model``.

    Args:
      comm_hook_type: a :class:`DDPCommHookType`.
      model: a jdist DDP wrapper (anything with ``register_comm_hook(state, hook)``).
      state: ``None`` or the DDP's process group; PowerSGD types wrap it in a
        :class:`PowerSGDState`.
    """
    if not isinstance(comm_hook_type, DDPCommHookType):
        raise TypeError(f"register_ddp_comm_hook expects a DDPCommHookType, got "
                        f"{comm_hook_type!r}; one of {[t.name for t in DDPCommHookType]}")
    hook, rank = _HOOKS[comm_hook_type]
    if rank is not None:
        state = PowerSGDState(process_group=state, matrix_approximation_rank=rank,
                              start_powerSGD_iter=1_000)
    model.register_comm_hook(state, hook)
