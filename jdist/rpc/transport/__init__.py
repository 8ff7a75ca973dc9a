"""RPC transports: how message frames move (TCP sockets, in-process queues).

Importing this package registers the ``tcp`` and ``inproc`` schemes.
"""

from jdist.rpc.transport import _inproc as _inproc  # noqa: F401  (registers "inproc")
from jdist.rpc.transport import _tcp as _tcp  # noqa: F401  (registers "tcp")
from jdist.rpc.transport._base import Comm as Comm
from jdist.rpc.transport._base import CommClosedError as CommClosedError
from jdist.rpc.transport._base import Listener as Listener
from jdist.rpc.transport._base import Transport as Transport
from jdist.rpc.transport._base import parse_address as parse_address
from jdist.rpc.transport._framing import FrameDecoder as FrameDecoder
from jdist.rpc.transport._framing import FrameError as FrameError
from jdist.rpc.transport._framing import encode_prefix as encode_prefix
from jdist.rpc.transport._registry import get_transport as get_transport
from jdist.rpc.transport._registry import register_transport as register_transport
from jdist.rpc.transport._registry import transport_schemes as transport_schemes

__all__ = [
    "Comm",
    "CommClosedError",
    "FrameDecoder",
    "FrameError",
    "Listener",
    "Transport",
    "encode_prefix",
    "get_transport",
    "parse_address",
    "register_transport",
    "transport_schemes",
]
