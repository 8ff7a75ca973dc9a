"""DDP comm hooks: pure ``hook(state, bucket) -> (buffer, new_state)`` functions."""

from jdist.ddp.hooks._base import CommHook as CommHook
from jdist.ddp.hooks._base import GradBucket as GradBucket

__all__ = ["CommHook", "GradBucket"]
