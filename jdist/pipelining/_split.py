"""``pipeline(layers, num_stages)``: a list of layers grouped into equal stages."""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

__all__ = ["pipeline"]


def pipeline(layers: Sequence[nnx.Module], num_stages: int) -> list[nnx.Sequential]:
    """``layers`` (applied in order) as ``num_stages`` ``nnx.Sequential`` stages of equal
    length (torch's ``pipeline()`` splits a traced model; NNX models are split by
    their layer list).

    Raises:
      ValueError: ``num_stages`` is not a positive int dividing ``len(layers)``.
    """
    layers = list(layers)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"pipeline: num_stages must be a positive int, got {num_stages!r}")
    if not layers or len(layers) % num_stages:
        raise ValueError(f"pipeline: {len(layers)} layers cannot be split into {num_stages} "
                         f"equal stages; choose a stage count that divides {len(layers)}")
    per = len(layers) // num_stages
    return [nnx.Sequential(*layers[i * per:(i + 1) * per]) for i in range(num_stages)]
