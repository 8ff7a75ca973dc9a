"""Messages between replicas: jdist's authenticated mailbox (``jdist/_mailbox.py``)
raising ``jdist.ft``'s errors.

Departure from DESIGN.md ("bytes between devices move through XLA"): across *replica
groups*, jdist.ft moves gradients and healed state over its own sockets, because XLA's
communicators are formed once per process and cannot drop or add a member (a dead
process aborts every JAX task). Inside a replica everything stays XLA's. This is
torchft's layout too (a reconfigurable process group for the replica dimension).
"""

from __future__ import annotations

from jdist._mailbox import Mailbox as _Mailbox
from jdist.errors import FtError, ReplicaLostError

__all__ = ["Mailbox"]


class Mailbox(_Mailbox):
    """A replica's mailbox: a lost or silent replica raises ReplicaLostError (the step
    does not commit), a missing or refused secret FtError."""

    word = "replica"
    lost_error = ReplicaLostError
    timeout_error = ReplicaLostError
    auth_error = FtError
    token_fix = "run under `jdist-run --ft` or set JDIST_AUTH_TOKEN (or auth_token=)"
