"""Shape buckets with an exact mask (``pad_batch_to``), published for the packages that
run DDP steps of their own (``jdist.rpc``'s DDP stage). The code lives in
``_padding.py``."""

from jdist.ddp._padding import PadSizes as PadSizes
from jdist.ddp._padding import pad_batch as pad_batch

__all__ = ["PadSizes", "pad_batch"]
