"""Key-value stores with torch's ``c10d`` store semantics.

``TCPStore`` (:mod:`._store_tcp`), ``FileStore`` (:mod:`._store_file`), ``HashStore``
and ``PrefixStore`` (:mod:`._store_local`), all subclasses of ``Store``
(:mod:`._store_base`). Import them from here or from ``jdist.collectives``.
"""

from jdist.collectives._store_base import Store as Store
from jdist.collectives._store_file import FileStore as FileStore
from jdist.collectives._store_local import HashStore as HashStore
from jdist.collectives._store_local import PrefixStore as PrefixStore
from jdist.collectives._store_tcp import TCPStore as TCPStore

__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore"]
