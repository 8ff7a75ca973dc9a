"""DDP comm hooks (``jdist.ddp.hooks``): torch's built-in hooks as pure functions.

A hook is ``hook(state, bucket) -> (reduced_flat_buffer, new_state)`` (see
:mod:`jdist.ddp.hooks._base`); the hook-state contract for reducers is in
:mod:`jdist.ddp.hooks._state`; what DDP checks at registration and about each result
is in :mod:`jdist.ddp.hooks._contract`; :func:`comm_report` lists the collectives a
compiled step asks for.
"""

from jdist.ddp.hooks._base import CommHook as CommHook
from jdist.ddp.hooks._base import GradBucket as GradBucket
from jdist.ddp.hooks._default import allreduce_hook as allreduce_hook
from jdist.ddp.hooks._default import bf16_compress_hook as bf16_compress_hook
from jdist.ddp.hooks._default import bf16_compress_wrapper as bf16_compress_wrapper
from jdist.ddp.hooks._default import bucket_with_buffer as bucket_with_buffer
from jdist.ddp.hooks._default import fp16_compress_hook as fp16_compress_hook
from jdist.ddp.hooks._default import fp16_compress_wrapper as fp16_compress_wrapper
from jdist.ddp.hooks._powersgd import PowerSGDState as PowerSGDState
from jdist.ddp.hooks._powersgd import batched_powerSGD_hook as batched_powerSGD_hook
from jdist.ddp.hooks._powersgd import powerSGD_hook as powerSGD_hook
from jdist.ddp.hooks._powersgd import should_compress as should_compress
from jdist.ddp.hooks._quantization import (
    quantization_perchannel_hook as quantization_perchannel_hook,
)
from jdist.ddp.hooks._quantization import (
    quantization_pertensor_hook as quantization_pertensor_hook,
)
from jdist.ddp.hooks._report import Collective as Collective
from jdist.ddp.hooks._report import CommReport as CommReport
from jdist.ddp.hooks._report import comm_report as comm_report
from jdist.ddp.hooks._state import init_hook_state as init_hook_state
from jdist.ddp.hooks._state import merge_static as merge_static
from jdist.ddp.hooks._state import split_static as split_static
from jdist.ddp.hooks._state import stack_hook_state as stack_hook_state
from jdist.ddp.hooks._state import stack_local as stack_local
from jdist.ddp.hooks._state import unstack_local as unstack_local
from jdist.ddp.hooks._types import DDPCommHookType as DDPCommHookType
from jdist.ddp.hooks._types import register_ddp_comm_hook as register_ddp_comm_hook

__all__ = [
    "Collective",
    "CommHook",
    "CommReport",
    "DDPCommHookType",
    "GradBucket",
    "PowerSGDState",
    "allreduce_hook",
    "batched_powerSGD_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "bucket_with_buffer",
    "comm_report",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "init_hook_state",
    "merge_static",
    "powerSGD_hook",
    "quantization_perchannel_hook",
    "quantization_pertensor_hook",
    "register_ddp_comm_hook",
    "should_compress",
    "split_static",
    "stack_hook_state",
    "stack_local",
    "unstack_local",
]
