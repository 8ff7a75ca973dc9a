"""A job of real processes kept alive across generated cases (torch's or jdist's).

Differential tests run hundreds of small cases; starting a job per case would spend the
suite's minutes on process starts and ``init_process_group``. A ``Pool`` starts one job
(``tests.helpers.run_procs``: the suite's fork server, free ports, gloo) whose ranks
serve cases: ``pool.run(fn, *args)`` sends a module-level function to every rank over an
authenticated ``multiprocessing.connection`` and returns each rank's result, or raises
``CaseError`` with every rank's traceback. A case that does not finish within its
timeout kills the job (the next case starts a fresh one), so nothing hangs.

``pools.get(setup, nprocs, devices_per_proc)`` keeps one pool per layout for the test
process; ``pools.close_all()`` ends them (the fixture in ``conftest.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener, wait

START_TIMEOUT_S = 120.0
CASE_TIMEOUT_S = 120.0
_JOB_TIMEOUT_S = 3600.0  # the whole job's bound; the test session ends it earlier


class CaseError(AssertionError):
    """A case raised on one or more ranks (``errors``: rank -> (class name, message,
    traceback)) or timed out."""

    def __init__(self, message: str, errors: dict[int, tuple[str, str, str]]):
        super().__init__(message)
        self.errors = errors


# ---------------------------------------------------------------- in the ranks


def _setup(setup: str):
    if setup.endswith("_rpc"):  # workers w0, w1, ... of an rpc job, no process group
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if setup == "torch_rpc":
            import torch
            import torch.distributed.rpc as rpc

            torch.set_num_threads(1)
        else:
            from jdist import rpc
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
        return rank
    if setup == "torch":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        return dist.get_rank()
    import jdist

    jdist.collectives.init_process_group()
    return jdist.collectives.get_rank()


def _teardown(setup: str) -> None:
    if setup.endswith("_rpc"):
        if setup == "torch_rpc":
            import torch.distributed.rpc as rpc
        else:
            from jdist import rpc
        rpc.shutdown()
        return
    if setup == "torch":
        import gc

        import torch.distributed as dist

        gc.collect()  # release DDP reducers before the group goes away
        dist.barrier()
        dist.destroy_process_group()
        return
    import jdist

    jdist.collectives.destroy_process_group()


def serve(address, authkey_hex: str, setup: str) -> None:
    """A rank's loop: set up the group, then run the cases the pool sends until None."""
    rank = _setup(setup)
    with Client(tuple(address), authkey=bytes.fromhex(authkey_hex)) as conn:
        conn.send((rank, os.getpid()))
        while (msg := conn.recv()) is not None:
            fn, args = msg
            try:
                conn.send(("ok", fn(*args)))
            except BaseException as e:  # noqa: BLE001 - reported to the test process
                conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))
    _teardown(setup)


# ---------------------------------------------------------------- in the test process


class Pool:
    """One job of ``nprocs`` ranks serving cases (``setup``: "jdist" or "torch" for a
    process group, "jdist_rpc" or "torch_rpc" for rpc workers ``w0``, ``w1``, ...)."""

    def __init__(self, setup: str, nprocs: int, devices_per_proc: int = 1):
        self.setup, self.nprocs, self.devices_per_proc = setup, nprocs, devices_per_proc
        self.conns: dict[int, object] = {}
        self.pids: dict[int, int] = {}
        self.job_error: BaseException | None = None
        key = os.urandom(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        self._thread = threading.Thread(target=self._job, args=(key.hex(),), daemon=True)
        self._thread.start()
        self._accept()

    def _job(self, key_hex: str) -> None:
        from tests.helpers import run_procs

        try:
            run_procs(serve, self.nprocs, args=(self._listener.address, key_hex, self.setup),
                      devices_per_proc=self.devices_per_proc, timeout=_JOB_TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - read by the test process
            self.job_error = e
            self._listener.close()  # ends a pending accept()

    def _accept(self) -> None:
        done = threading.Event()
        out: list = []

        def accept_all():
            try:
                for _ in range(self.nprocs):
                    conn = self._listener.accept()
                    rank, pid = conn.recv()
                    self.conns[rank], self.pids[rank] = conn, pid
            except BaseException as e:  # noqa: BLE001
                out.append(e)
            done.set()

        threading.Thread(target=accept_all, daemon=True).start()
        if not done.wait(START_TIMEOUT_S) or out:
            self.kill()
            raise RuntimeError(f"{self!r} did not start within {START_TIMEOUT_S:.0f} s: "
                               f"{self.job_error or (out[0] if out else 'no error')}")

    def __repr__(self) -> str:
        return f"Pool({self.setup!r}, {self.nprocs} processes x {self.devices_per_proc})"

    @property
    def alive(self) -> bool:
        return self.job_error is None and len(self.conns) == self.nprocs

    def run(self, fn, *args, timeout: float = CASE_TIMEOUT_S) -> list:
        """``fn(*args)`` on every rank; the ranks' results in rank order.

        Anything that interrupts the wait (a test timeout, ^C) kills the job: replies
        still in flight would otherwise answer the next case."""
        try:
            return self._run(fn, args, timeout)
        except CaseError:
            raise
        except BaseException:
            self.kill()
            raise

    def _run(self, fn, args, timeout: float) -> list:
        if not self.alive:
            raise CaseError(f"{self!r} is not running: {self.job_error}", {})
        for conn in self.conns.values():
            conn.send((fn, args))
        results: dict[int, tuple] = {}
        by_conn = {id(c): r for r, c in self.conns.items()}
        deadline = time.monotonic() + timeout
        while len(results) < self.nprocs:
            left = deadline - time.monotonic()
            ready = wait([c for r, c in self.conns.items() if r not in results],
                         timeout=max(left, 0))
            if not ready:
                self.kill()
                missing = sorted(set(self.conns) - set(results))
                raise CaseError(f"{fn.__name__} timed out after {timeout:.0f} s on ranks "
                                f"{missing} of {self!r}", self._errors(results))
            for conn in ready:
                try:
                    results[by_conn[id(conn)]] = conn.recv()
                except (EOFError, OSError) as e:
                    self.kill()
                    raise CaseError(f"{fn.__name__}: a rank of {self!r} died ({e}); "
                                    f"{self.job_error}", self._errors(results)) from e
            if any(kind == "err" for kind, _ in results.values()) and \
                    len(results) < self.nprocs:
                deadline = min(deadline, time.monotonic() + 10.0)  # the others may hang
        errors = self._errors(results)
        if errors:
            first = errors[min(errors)]
            raise CaseError(f"{fn.__name__} raised on ranks {sorted(errors)}: "
                            f"{first[0]}: {first[1]}\n{first[2]}", errors)
        return [results[r][1] for r in range(self.nprocs)]

    @staticmethod
    def _errors(results: dict) -> dict:
        return {r: v for r, (kind, v) in results.items() if kind == "err"}

    def close(self, timeout: float = 60.0) -> None:
        if self.alive:
            try:
                for conn in self.conns.values():
                    conn.send(None)
            except OSError:
                pass
            self._thread.join(timeout)
        if self._thread.is_alive():
            self.kill()
        self._listener.close()

    def kill(self) -> None:
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._thread.join(30)
        self.conns.clear()
        self.job_error = self.job_error or RuntimeError("killed")


class Pools:
    """One live pool per (setup, nprocs, devices_per_proc), restarted when killed."""

    def __init__(self):
        self._pools: dict[tuple, Pool] = {}

    def get(self, setup: str, nprocs: int, devices_per_proc: int = 1) -> Pool:
        key = (setup, nprocs, devices_per_proc)
        pool = self._pools.get(key)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close(5)
            pool = self._pools[key] = Pool(*key)
        return pool

    def close_all(self) -> None:
        """End every pool at once with SIGKILL: nothing in an idle pool needs a clean
        exit, and closing them one after the other (each rank's teardown, then JAX's
        and torch's exit handlers) kept a worker busy for up to 30 s at the end of the
        suite, the other workers done."""
        for pool in self._pools.values():
            for pid in pool.pids.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pool in self._pools.values():
            pool.kill()
            pool._listener.close()
        self._pools.clear()


pools = Pools()
