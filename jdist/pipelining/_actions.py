"""Schedule actions: what one pipeline rank does at one slot of a schedule.

An action names a stage, a computation and a micro-batch, and prints as torch's
``_Action`` does (``"2F0"``: stage 2, forward, micro-batch 0), so a jdist schedule and a
torch schedule can be compared by their text. ``None`` in an order is an idle slot.
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

__all__ = ["Kind", "Action", "parse", "compute_only"]


class Kind(str, enum.Enum):
    """The computations of a schedule (torch's letters)."""

    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients together
    BACKWARD_INPUT = "I"  # the input gradient only (zero-bubble schedules)
    BACKWARD_WEIGHT = "W"  # the weight gradient of an earlier "I"


class Action(NamedTuple):
    """One computation: ``stage`` (global stage index), ``kind``, ``microbatch``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __repr__ = __str__


_TEXT = re.compile(r"^(\d+)([FBIW])(\d+)$")


def parse(text: str) -> Action | None:
    """The action written ``text`` (``"1B3"``); ``""`` is an idle slot (None).

    Raises:
      ValueError: ``text`` is not ``<stage><F|B|I|W><microbatch>``.
    """
    text = text.strip()
    if not text:
        return None
    m = _TEXT.match(text)
    if m is None:
        raise ValueError(f"not a schedule action: {text!r}; write <stage><F|B|I|W>"
                         f"<microbatch>, e.g. '2F0'")
    return Action(int(m.group(1)), Kind(m.group(2)), int(m.group(3)))


def compute_only(order: list[Action | None]) -> list[Action]:
    """``order`` without its idle slots."""
    return [a for a in order if a is not None]
