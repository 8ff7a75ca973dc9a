"""Key-value stores with torch's ``c10d`` store semantics (floor 0: no JAX).

| file | job |
| --- | --- |
| ``_base.py`` | ``Store`` (the contract, argument normalising) and the pure ``kv_*`` core |
| ``_hash.py`` | ``HashStore``: in-process, thread-safe |
| ``_prefix.py`` | ``PrefixStore``: a key-prefixed view of another store |
| ``_file.py`` | ``FileStore``: processes of one machine share a file |
| ``_wire.py`` | the TCP store's handshake, frames and op codes |
| ``_server.py`` | the TCP store's server (one selector thread) |
| ``_tcp.py`` | ``TCPStore``: the client, and the server it starts as master |
| ``_port.py`` | ``free_port`` |

``jdist.store`` imports no JAX: the launcher and the RPC rendezvous use it without
loading XLA. ``jdist.collectives`` and ``jdist`` re-export the store names, as
``torch.distributed`` does.
"""

from jdist.store._base import Store as Store
from jdist.store._file import FileStore as FileStore
from jdist.store._hash import HashStore as HashStore
from jdist.store._port import free_port as free_port
from jdist.store._prefix import PrefixStore as PrefixStore
from jdist.store._tcp import TCPStore as TCPStore

__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore", "free_port"]
