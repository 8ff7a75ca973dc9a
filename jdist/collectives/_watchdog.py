"""Dead-peer detection: heartbeats through the store, plus a local process check.

Every rank of a multi-process job runs one daemon thread that bumps the counter
``jdist/hb/<generation>/<rank>`` in the store every ``interval`` seconds. When an eager
collective fails (gloo reports "Connection closed by peer") or a store wait runs long,
:meth:`Watchdog.diagnose` finds which ranks are gone:

- a rank on this host whose process no longer exists (or is a zombie) is dead at once;
- otherwise a rank whose counter did not move for ``3 * interval`` seconds is dead;
- if the store itself is unreachable, its host (rank 0) is dead.

The caller raises :class:`jdist.errors.PeerFailedError` naming those ranks. The beat
also publishes which collective (group, sequence number) this rank last entered, so a
collective that times out names the ranks that never reached it (:meth:`behind`), each
with the Python stack of its main thread as that rank last published it (every beat,
when it changed; ``JDIST_STACKS=0`` turns it off) and, on this host, whether its
process is stopped (``SIGSTOP``, a debugger): a stuck rank is named with where it is,
even when it can no longer answer. All store traffic of the runtime after init goes
through :attr:`Watchdog.lock` (one client).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback

from jdist.collectives._stuck import StuckDeadline

__all__ = ["Watchdog", "process_alive", "process_state", "main_stack"]

STACK_FRAMES = 12  # innermost frames of the main thread a beat publishes
STACK_CHARS = 4000


def process_state(pid: int) -> str:
    """The one-letter state of process ``pid`` on this host (``/proc``), or "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def main_stack(limit: int = STACK_FRAMES) -> str:
    """The main thread's current Python stack, innermost frames last (as a traceback)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    text = "".join(traceback.format_stack(frame, limit=limit))
    return text[-STACK_CHARS:]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host exists and is not a zombie."""
    state = process_state(pid)
    if state:
        return state not in ("Z", "X")
    if os.path.isdir("/proc/self"):  # /proc works and has no such process
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Watchdog:
    """Heartbeat sender and failure diagnosis for one process of a job.

    Args:
      store: the job's store client (used only under :attr:`lock`).
      rank: this process's WORLD rank.
      infos: each rank's rendezvous info (``host``, ``pid``).
      generation: the init generation (keys are per generation).
      interval: seconds between heartbeats.
      store_host_rank: the rank hosting the store (0), or None for a file/hash store.
    """

    def __init__(self, store, rank: int, infos, generation: int, interval: float = 1.0,
                 store_host_rank: int | None = 0, stuck_timeout: float | None = None) -> None:
        self.store = store
        self.rank = rank
        self.infos = tuple(infos)
        self.interval = float(interval)
        self.prefix = f"jdist/hb/{generation}/"
        self.store_host_rank = store_host_rank
        self.lock = threading.Lock()
        self.dead: dict[int, str] = {}
        self.progress: dict[str, tuple[int, str]] = {}
        self._calls: dict[str, tuple[int, str, float, tuple[int, ...]]] = {}
        self._published = ""
        self.stacks = os.environ.get("JDIST_STACKS", "1") != "0"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jdist-heartbeat", daemon=True)
        self.deadline = None if stuck_timeout is None else StuckDeadline(self, stuck_timeout)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1.0)

    def note(self, group: str, seq: int, what: str, ranks=()) -> None:
        """Record that this rank entered collective ``seq`` (``what``) of ``group``,
        whose members are ``ranks``."""
        self._calls[group] = (seq, what, time.monotonic(), tuple(ranks))  # (one store)
        self.progress[group] = (seq, what)

    def waits(self) -> dict[str, tuple[int, str, float, tuple[int, ...]]]:
        """``{channel: (number, name, entered at (monotonic), members)}`` of this rank's
        last call on each channel (a call may have ended since: see ``_stuck.py``)."""
        return dict(self._calls)

    def _beat(self) -> bool:
        try:
            progress = json.dumps(self.progress)
            with self.lock:
                self.store.add(self.prefix + str(self.rank), 1)
                if progress != self._published:
                    self.store.set(self.prefix + f"progress/{self.rank}", progress)
                    self._published = progress
                if self.stacks:
                    self.store.set(self.prefix + f"stack/{self.rank}",
                                   json.dumps({"t": time.time(), "stack": main_stack()}))
            return True
        except Exception:  # the store host may be gone; diagnosis reports it
            return False

    def positions(self, ranks, group: str) -> dict[int, tuple[int, str] | None]:
        """The collective (sequence number, name) each of ``ranks`` last published for
        ``group``: None if it published none; ranks not readable are left out."""
        out: dict[int, tuple[int, str] | None] = {}
        try:
            with self.lock:
                for r in ranks:
                    if r == self.rank:
                        continue
                    key = self.prefix + f"progress/{r}"
                    prog = json.loads(self.store.get(key)) if self.store.check([key]) else {}
                    at = prog.get(group)
                    out[r] = None if at is None else (int(at[0]), str(at[1]))
        except Exception:
            return out
        return out

    def behind(self, ranks, group: str, seq: int, noun: str = "collective") -> dict[int, str]:
        """Ranks (of ``ranks``) that have not entered ``noun`` ``seq`` of ``group`` (a
        group's name, or a channel of its compiled steps: :func:`_engine.enter_step`).

        Values say where each of them is, from the progress they last published, and
        what its main thread was running (:meth:`where`).
        """
        out = {}
        for r, at in self.positions(ranks, group).items():
            if at is None or at[0] < seq:
                out[r] = (f"has not entered any {noun} on this group" if at is None
                          else f"is still at {noun} #{at[0]} ({at[1]})") + self.where(r)
        return out

    def where(self, rank: int) -> str:
        """``"; its process is stopped ...; its main thread 0.4 s ago:\n  File ..."``:
        rank ``rank``'s process state (on this host) and last published stack."""
        info = self.infos[rank] if rank < len(self.infos) else {}
        state = (process_state(int(info["pid"])) if info.get("host") == socket.gethostname()
                 and "pid" in info else "")
        text = ("; its process is stopped (SIGSTOP, a debugger or job control): it "
                "cannot answer until it is continued" if state in ("T", "t") else "")
        try:
            with self.lock:
                key = self.prefix + f"stack/{rank}"
                rec = json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:
            rec = None
        if rec and rec.get("stack"):
            age = max(0.0, time.time() - float(rec["t"]))
            lines = "\n".join("    " + ln for ln in str(rec["stack"]).rstrip().splitlines())
            text += f"; its main thread {age:.1f} s ago:\n{lines}\n"
        return text

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self._beat():
                if self._stop.wait(self.interval):
                    return
            elif self.deadline is not None:
                self.deadline.check()

    def counters(self, ranks) -> dict[int, int] | None:
        """Each rank's heartbeat counter (-1: none yet); None if the store is gone."""
        out = {}
        try:
            with self.lock:
                for r in ranks:
                    key = self.prefix + str(r)
                    out[r] = int(self.store.get(key)) if self.store.check([key]) else -1
        except Exception:
            return None
        return out

    def diagnose(self, ranks, wait: float | None = None) -> dict[int, str]:
        """Which of ``ranks`` (WORLD ranks) are dead, with a reason for each.

        Waits up to ``wait`` seconds (default ``3 * interval + 0.5``) to see whether
        heartbeat counters move; ``wait=0`` only checks processes on this host. Dead
        ranks are remembered in :attr:`dead`.
        """
        wait = 3 * self.interval + 0.5 if wait is None else wait
        here = socket.gethostname()
        others = [r for r in ranks if r != self.rank]
        dead = {r: self.dead[r] for r in others if r in self.dead}
        for r in others:
            info = self.infos[r]
            if info.get("host") == here and not process_alive(int(info["pid"])):
                dead[r] = f"its process (pid {info['pid']}) has exited"
        if dead or wait <= 0:  # without time to watch counters, only the local check
            self.dead.update(dead)
            return dead
        first = self.counters(others)
        if first is None:
            if self.store_host_rank is not None and self.store_host_rank != self.rank:
                dead[self.store_host_rank] = "the store it hosts is unreachable"
            self.dead.update(dead)
            return dead
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            for r in others:
                info = self.infos[r]
                if info.get("host") == here and not process_alive(int(info["pid"])):
                    dead[r] = f"its process (pid {info['pid']}) has exited"
            if dead:
                break
        if not dead:
            second = self.counters(others)
            if second is None:
                if self.store_host_rank is not None and self.store_host_rank != self.rank:
                    dead[self.store_host_rank] = "the store it hosts is unreachable"
            else:
                for r in others:
                    if second[r] == first[r]:
                        dead[r] = f"it sent no heartbeat for {wait:.1f} s"
        self.dead.update(dead)
        return dead
