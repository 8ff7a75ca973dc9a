"""How many threads XLA's CPU client runs in this process (``JDIST_XLA_CPU_THREADS``).

torchrun gives each of several processes on a node ``OMP_NUM_THREADS=1`` so that they
do not oversubscribe its cores; jdist-run does too. XLA reads neither that variable
nor, since its CPU thunk runtime, ``--xla_cpu_multi_thread_eigen=false`` (measured on
jax 0.10: a matmul still ran on two threads). It sizes its thread pools once, when the
CPU client is made, from the CPUs the creating thread may run on
(``sched_getaffinity``). So, with ``JDIST_XLA_CPU_THREADS=n``, the CPU client is made
while the creating thread may run on ``n`` of its CPUs only; afterwards that thread and
every thread made meanwhile get their whole CPU set back. The pools keep ``n`` threads
and no thread is pinned: a pinned thread waits for its one core, and on a 2-core
machine that slowed every collective's tail (p90 0.9 -> 3.6 ms).

XLA also runs whole programs on that pool, so a blocking collective holds one of its
threads: with one thread, two programs in flight that ranks dispatched in different
orders wait for each other for ever. jdist-run therefore gives each process its share
of the cores but at least 2 (``jdist.launch._env.xla_threads``); 1 is for programs
with at most one collective in flight at a time. Measured with 1 on 2 cores, 2
processes (``benchmarks/collectives.py``'s training loop, as its torch side runs
``torch.set_num_threads(1)``): the CNN's gradient step 18.3 -> 15.8 ms, its eight
eager all-reduces 13.2 -> 10.6 ms.

The hook is installed before JAX makes its CPU client and costs nothing until then:
when ``jax._src.xla_bridge`` is imported (at once if it already is). Where JAX's
internals differ, or the CPU client already exists, it warns and does nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Mapping

__all__ = ["ENV", "limit_from_env", "limit_cpu_threads", "parse_threads"]

ENV = "JDIST_XLA_CPU_THREADS"
_BRIDGE = "jax._src.xla_bridge"


def parse_threads(environ: Mapping[str, str]) -> int | None:
    """``JDIST_XLA_CPU_THREADS`` as a positive int, or None when unset or empty.

    Raises:
      ValueError: the value is not a positive integer (the message quotes it).
    """
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={raw!r}: expected a positive number of threads for XLA's "
                         f"CPU client (e.g. {ENV}=1), or leave it unset for every core")
    return n


def limit_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """Apply ``JDIST_XLA_CPU_THREADS`` (see the module doc); the number, or None."""
    n = parse_threads(os.environ if environ is None else environ)
    if n is not None:
        limit_cpu_threads(n)
    return n


def limit_cpu_threads(n: int) -> None:
    """Make JAX's CPU client, when it is made, run ``n`` threads per pool."""
    if not hasattr(os, "sched_setaffinity"):
        return  # (no per-thread CPU sets here: XLA sizes its pools by the core count)
    bridge = sys.modules.get(_BRIDGE)
    if bridge is not None:
        _wrap(bridge, n)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_BRIDGE, lambda m: _wrap(m, n)))


def _wrap(bridge, n: int) -> None:
    try:
        if bridge.backends_are_initialized():
            warnings.warn(f"{ENV}={n} came after JAX made its CPU client; XLA keeps its "
                          f"threads (set it before the program's first JAX call)",
                          stacklevel=2)
            return
        reg = bridge._backend_factories["cpu"]
        factory = reg.factory
        if getattr(factory, "_jdist_threads", None) == n:
            return
        bridge._backend_factories["cpu"] = dataclasses.replace(
            reg, factory=_sized(getattr(factory, "_jdist_inner", factory), n))
    except (AttributeError, KeyError, TypeError) as exc:
        warnings.warn(f"{ENV}={n} could not reach JAX's CPU client factory ({exc!r}); "
                      f"XLA keeps its threads", stacklevel=2)


def _sized(factory: Callable, n: int) -> Callable:
    def make(*args, **kwargs):
        mine = os.sched_getaffinity(0)
        before = _threads()
        os.sched_setaffinity(0, set(sorted(mine)[:n]))
        try:
            return factory(*args, **kwargs)
        finally:
            for tid in _threads() - before:
                try:
                    os.sched_setaffinity(tid, mine)
                except OSError:
                    pass  # (a thread that ended meanwhile)
            os.sched_setaffinity(0, mine)

    make._jdist_threads = n
    make._jdist_inner = factory
    return make


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once module ``name`` has been imported (one shot)."""

    def __init__(self, name: str, then: Callable) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, then = spec.loader.exec_module, self.then

        def exec_module(module):
            run(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec
