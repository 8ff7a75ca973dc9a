"""``is_torchelastic_launched``: whether this process was started by an elastic launcher."""

from __future__ import annotations

import os

__all__ = ["is_torchelastic_launched"]


def is_torchelastic_launched() -> bool:
    """True when this process was started by ``jdist-run`` (or torchrun), as
    ``torch.distributed.is_torchelastic_launched``: the launcher gives its workers
    ``TORCHELASTIC_RUN_ID`` (the job's ``--rdzv-id``), which no other start sets."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None
