"""Errors of :mod:`jdist.checkpoint`; each docstring says the cause and the fix."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointCorruptError", "CheckpointMismatchError"]


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be used by this job.

    Cause: the directory holds no step that every rank finished while older parts
    exist (ranks missing), or it was written by a job of another world size and
    ``elastic`` is off. Fix: the message names what is missing; point the manager at
    the right directory, pass ``elastic=True``, or remove the directory to start over.
    """


class CheckpointCorruptError(CheckpointError):
    """A finished checkpoint part cannot be read back (truncated or changed file).

    Cause: a file of the part named in the message fails to load or its checksum
    differs from the one recorded at save time (disk error, a copy cut short, a file
    edited by hand). Restore falls back to the previous complete step and warns; this
    error is raised only when no readable complete step is left.
    """


class CheckpointMismatchError(CheckpointError, ValueError):
    """The saved state does not fit the state it is restored into.

    Cause: the model or optimizer has another structure, shape or dtype than the saved
    one (the message names the first differing path and both values), or per-replica
    state (a comm hook's error feedback, ZeRO shards that cannot be re-split) was saved
    for another number of replicas. Fix: build the same model and optimizer as the
    saving run, or start from a new directory.
    """
