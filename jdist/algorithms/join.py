"""torch.distributed.algorithms.join for jdist: ``Join``, ``Joinable``, ``JoinHook``.

See :mod:`jdist.algorithms._join` for the algorithm.
"""

from jdist.algorithms._join import DETECTED_MSG as DETECTED_MSG
from jdist.algorithms._join import EXHAUSTED_MSG as EXHAUSTED_MSG
from jdist.algorithms._join import Join as Join
from jdist.algorithms._join import Joinable as Joinable
from jdist.algorithms._join import JoinConfig as JoinConfig
from jdist.algorithms._join import JoinHook as JoinHook

__all__ = ["DETECTED_MSG", "EXHAUSTED_MSG", "Join", "JoinConfig", "JoinHook", "Joinable"]
