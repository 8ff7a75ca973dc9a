"""Every process of a multi-process job writes its own persistent compilation cache entries.

JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``; jdist-run turns it on)
lets a re-run of a program load what an earlier run compiled. In a multi-process job
only process 0 ever gains from it, because of two things in JAX (0.10):

- ``jax._src.compiler._cache_write`` returns before writing unless the process index
  is 0 (so that the processes of a job do not contend on a shared filesystem);
- the cache key differs from process to process on CPU: it hashes the compile options,
  whose device assignment names the process's own devices for a program local to it
  (``jax.random`` key set-up, the eager pieces of a step), and the topology
  fingerprint of the program's devices, which differs per process even for a
  program over every process's devices (measured: a DDP step, the same text on both
  ranks, gets two keys). Only on GPU does JAX strip the device assignment.

So rank 0's entries are never what rank 1 looks up, and rank 1 writes none: every
warm re-run compiles all of rank 1's programs again (a two-trainer job ran at 9x
torch's wall time, most of it compiling on the ranks above 0).

:func:`write_on_every_process` fixes it at the write: a process other than 0 writes
its entries itself, with JAX's thresholds (minimum compile time, minimum entry size,
no host callbacks) and JAX's entry format (serialized executable and compile time,
compressed), so JAX's own read finds them. An entry already on disk is left alone, and
in a plain cache directory (JAX's default, no size limit) an entry appears at once,
written aside and then hard-linked into place, so processes whose keys coincide never
interleave their writes or expose half an entry; in a size-limited cache the write
goes through JAX's writer, under its lock.
"""

from __future__ import annotations

import inspect
import os
import tempfile
import warnings
from typing import Any

__all__ = ["write_on_every_process", "writes_on_every_process"]

_PARAMS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable",
           "host_callbacks")
_MARK = "_jdist_every_process"


def writes_on_every_process() -> bool:
    """Whether :func:`write_on_every_process` is in force in this process."""
    from jax._src import compiler

    return bool(getattr(getattr(compiler, "_cache_write", None), _MARK, False))


def write_on_every_process() -> bool:
    """Let this process write persistent compilation cache entries whatever its index.

    Idempotent. Returns whether it is in force; False (with a warning) when this JAX's
    cache writer is not the one this was written for, in which case JAX's own rule
    stands (only process 0 writes).
    """
    from jax._src import compiler, distributed

    original = getattr(compiler, "_cache_write", None)
    if getattr(original, _MARK, False):
        return True
    try:
        names = tuple(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        names = ()
    if names != _PARAMS:
        warnings.warn(
            f"jdist: JAX's persistent cache writer (jax._src.compiler._cache_write) has "
            f"parameters {names}, not {_PARAMS}; processes other than 0 will not write "
            f"compilation cache entries (a warm re-run compiles again there). Use the "
            f"JAX version jdist was tested with, or report it", stacklevel=2)
        return False

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                    host_callbacks):
        if not distributed.global_state.process_id:  # None or 0: JAX writes itself
            return original(cache_key, compile_time_secs, module_name, backend,
                            executable, host_callbacks)
        return _write_entry(cache_key, compile_time_secs, module_name, backend,
                            executable, host_callbacks)

    setattr(cache_write, _MARK, True)
    cache_write.__wrapped__ = original
    compiler._cache_write = cache_write
    return True


def _write_entry(cache_key: str, compile_time_secs: float, module_name: str, backend,
                 executable, host_callbacks) -> None:
    """Write one entry from a process other than 0 (JAX's thresholds and format)."""
    from jax._src import compilation_cache, config

    if host_callbacks:  # baked into the program: JAX never caches these
        return
    if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
        return
    try:
        cache = compilation_cache._get_cache(backend)
        if cache is None:
            return
        target = _plain_entry_path(cache, cache_key)
        if target is None:  # size-limited or remote: JAX's writer, under its lock
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs))
            return
        if os.path.exists(target):
            return
        blob = _entry_bytes(compilation_cache, executable, backend, int(compile_time_secs))
        if len(blob) < config.persistent_cache_min_entry_size_bytes.value:
            return
        _publish(target, blob)
    except Exception as exc:
        if config.raise_persistent_cache_errors.value:
            raise
        warnings.warn(f"jdist: could not write the persistent compilation cache entry of "
                      f"{module_name!r}: {type(exc).__name__}: {exc}", stacklevel=2)


def _plain_entry_path(cache: Any, cache_key: str) -> str | None:
    """The file of ``cache_key`` in a local cache directory without a size limit, else
    None (the entry must then go through JAX's writer)."""
    from jax._src import lru_cache

    if not isinstance(cache, lru_cache.LRUCache) or cache.eviction_enabled:
        return None
    root = str(cache.path)
    if "://" in root and not root.startswith("file://"):
        return None
    root = root.removeprefix("file://")
    return os.path.join(root, f"{cache_key}{lru_cache._CACHE_SUFFIX}")


def _entry_bytes(compilation_cache, executable, backend, compile_time: int) -> bytes:
    """What JAX stores for an executable: serialized, compile time appended, compressed."""
    if hasattr(executable, "serialize"):
        serialized = executable.serialize()
    else:
        serialized = backend.serialize_executable(executable)
    combined = compilation_cache.combine_executable_and_time(serialized, compile_time)
    return compilation_cache.compress_executable(combined)


def _publish(target: str, blob: bytes) -> None:
    """Make ``target`` hold ``blob`` at once, unless it exists already."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".jdist-entry-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        try:
            os.link(tmp, target)
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links: replace is atomic too
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
