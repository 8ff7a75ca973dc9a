"""Save, then exit, on SIGTERM: ``CheckpointManager(..., save_on_preemption=True)``.

A scheduler that preempts a job (SLURM, Kubernetes, a spot instance) sends SIGTERM and
SIGKILLs after a grace period. Without this option a worker ends at SIGTERM, as torch's
does. With it, SIGTERM only notes the time, and the training loop's next
:meth:`CheckpointManager.save` call turns it into a save every rank agrees on:

- Every ``save`` call asks all ranks whether any of them got the signal (the manager's
  MAX agreement: one small eager collective per call, so ``save`` must be called by
  every rank at every step, as it returns at once off the interval). Collectives are
  matched in order, so every rank gets the same answer at the same step, however far
  one rank's Python runs ahead of another's: no rank can pass the stop step.
  (Waiting for the others through the store instead deadlocks: a rank one step ahead
  sits in that step's collective, which needs the rank that waits.)
- At that step every rank saves (whatever ``save_interval_steps`` says), waits until
  its part is on disk, and exits with status 143 (128 + SIGTERM) through
  ``SystemExit``, so ``finally`` blocks and ``atexit`` run. ``jdist-run
  --max-restarts`` then resumes from that step, and a scheduler sees a preempted job,
  not a finished one.

The handler is Python's, so it runs between bytecodes of the main thread: a step stuck
in a collective answers it when the collective returns.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["Preemption", "EXIT_CODE"]

EXIT_CODE = 128 + signal.SIGTERM


class Preemption:
    """The SIGTERM handler and the per-step question "did any rank get it?".

    Args:
      rank: this process's rank (for messages).
      agree: ``agree(code)`` -> the largest ``code`` of all ranks (a collective).
    """

    def __init__(self, rank: int, agree: Callable[[int], int]):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("save_on_preemption=True installs a SIGTERM handler, which "
                             "only the main thread can do; create the CheckpointManager "
                             "in the main thread")
        self.rank, self._agree = rank, agree
        self.signalled_at: float | None = None
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.time()
            print(f"jdist.checkpoint: rank {self.rank} got SIGTERM; every rank saves at the "
                  "next step, then exits", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Give SIGTERM back to the handler that was there before (main thread only)."""
        if self._previous is not None and \
                threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def is_stop_step(self) -> bool:
        """Whether this ``save`` must save and then exit (every rank gets the same
        answer: call it from every save, on every rank)."""
        return self._agree(int(self.signalled_at is not None)) > 0

    def exit(self, step: int) -> None:
        print(f"jdist.checkpoint: rank {self.rank} saved step {step} after SIGTERM; exiting "
              f"with status {EXIT_CODE}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE)
