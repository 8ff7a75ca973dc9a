"""One rank's pieces packed into one flat buffer per dtype, and sliced back out.

A part holds a few large arrays instead of one per leaf: Orbax and TensorStore then
open, write, record and merge a handful of arrays per save (a DDP model with Adam has
dozens of leaves), and the copy of the training state is one pass that writes each
piece straight into its buffer. Each buffer carries one 64-bit XXH3 checksum
(:func:`buffer_checksum`), computed in the writer's thread and checked once when the
buffer is read back; parts written before carry a CRC-32 instead, still checked.

A save takes :func:`to_host` in the training loop and leaves :func:`pack` to the
writer's thread: on a CPU device ``to_host`` costs no copy at all (a numpy view of each
device buffer, safe to read later because JAX arrays never change and JAX does not
donate a buffer that a view still shares), so the loop does not pay for the copy.
"""

from __future__ import annotations

import json
import zlib

import jax
import numpy as np
import xxhash

__all__ = ["FORMAT", "READABLE", "to_host", "layout", "pack", "buffer_checksum",
           "checksum_ok", "piece_of", "record_digest", "record_ok"]

# the part's layout (1: one array per piece, 2: one buffer per dtype, 3: 2 with the JSON
# record's own checksum); a part of format 2 is still read, its record unchecked
FORMAT = 3
READABLE = (2, 3)


def _name(dtype: np.dtype) -> str:
    return f"{dtype.name}_buffer"


def to_host(pieces: list) -> list[np.ndarray]:
    """Host values of ``pieces`` that stay valid whatever the caller does next.

    Jax arrays come back from one ``jax.device_get`` (the transfers overlap; on CPU,
    views of the device buffers); any other value (a numpy array the caller may change
    in place, a scalar) is copied.
    """
    host = jax.device_get(list(pieces))
    return [np.asarray(h) if isinstance(p, jax.Array) else np.array(h, copy=True)
            for p, h in zip(pieces, host, strict=True)]


def layout(host: list) -> tuple[dict, list]:
    """``({buffer name: (dtype, elements)}, [(buffer, offset, shape), ...])``: where
    :func:`pack` puts each of ``host``'s arrays."""
    sizes: dict = {}
    places = []
    for a in host:
        name = _name(a.dtype)
        offset = sizes.get(name, (a.dtype, 0))[1]
        sizes[name] = (a.dtype, offset + a.size)
        places.append((name, offset, list(a.shape)))
    return sizes, places


def pack(pieces: list, spare: dict | None = None) -> tuple[dict, list]:
    """``({buffer name: flat array}, [(buffer, offset, shape), ...])`` of ``pieces``.

    ``pieces`` are array values (jax arrays, numpy arrays, scalars; :func:`to_host`'s
    result in a save), copied into buffers of their own. A buffer of ``spare`` (an
    earlier result whose write has finished) with the same name, dtype and size is
    filled again instead of a new one: its memory is already mapped, while a fresh
    buffer of the training state's size costs a page fault per 4 KiB.
    """
    host = [np.asarray(a) for a in jax.device_get(list(pieces))]
    sizes, places = layout(host)
    spare = spare or {}
    buffers = {}
    for name, (dtype, n) in sizes.items():
        old = spare.get(name)
        ok = old is not None and old.dtype == dtype and old.shape == (n,)
        buffers[name] = old if ok else np.empty((n,), dtype)
    for a, (name, offset, _) in zip(host, places, strict=True):
        buffers[name][offset:offset + a.size] = a.reshape(-1)
    return buffers, places


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def buffer_checksum(a: np.ndarray) -> dict:
    """The checksum a buffer's record carries: XXH3-64 of its bytes, as
    ``{"xxh3": <int>}``.

    A save computes one per buffer in the writer's thread, and on a busy machine that CPU
    time is taken from the training step: XXH3 reads memory several times faster than
    zlib's CRC-32 (docs/fault-tolerance.md), and releases the GIL as CRC-32 does.
    """
    return {"xxh3": xxhash.xxh3_64_intdigest(_bytes(a))}


def checksum_ok(a: np.ndarray, rec: dict) -> bool:
    """Whether ``a`` matches its record's checksum: XXH3-64, or the CRC-32 of parts
    written by an earlier jdist (``{"crc": <int>}``)."""
    if rec.get("xxh3") is not None:
        return buffer_checksum(a)["xxh3"] == rec["xxh3"]
    if rec.get("crc") is not None:
        return zlib.crc32(_bytes(a)) == rec["crc"]
    return False


def record_digest(meta: dict) -> int:
    """XXH3-64 of a part's JSON record (without its ``"digest"``), in canonical form."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_64_intdigest(text.encode())


def record_ok(meta: dict) -> bool:
    """Whether a record read back matches its ``"digest"``; a record without one passes
    only as format 2 (written before records carried one). Every number, name, offset
    and JSON value restore reads is in the record, so one changed bit is caught here."""
    if "digest" not in meta:
        return meta.get("format") == 2
    try:
        return meta["digest"] == record_digest(meta)
    except (TypeError, ValueError):  # not JSON-able any more (a NaN, a bad key)
        return False


def piece_of(buffer: np.ndarray, offset: int, shape) -> np.ndarray:
    """A copy of the piece at ``offset`` (a copy: the restored value must not keep the
    whole buffer alive, nor share memory with the other pieces)."""
    n = int(np.prod(shape, dtype=np.int64))
    if offset < 0 or offset + n > buffer.shape[0]:
        raise ValueError(f"a piece of shape {tuple(shape)} at offset {offset} does not fit "
                         f"in a buffer of {buffer.shape[0]} elements")
    return buffer[offset:offset + n].reshape(shape).copy()
