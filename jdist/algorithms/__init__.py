"""jdist.algorithms: torch.distributed.algorithms for jdist (the generic ``Join``).

``jdist.algorithms.join`` holds :class:`Join`, :class:`Joinable` and :class:`JoinHook`
under torch's names: training with uneven numbers of inputs per process, for DDP,
ZeRO and user classes alike.
"""

from jdist.algorithms import join as join
from jdist.algorithms._join import Join as Join
from jdist.algorithms._join import Joinable as Joinable
from jdist.algorithms._join import JoinHook as JoinHook

__all__ = ["Join", "JoinHook", "Joinable", "join"]
