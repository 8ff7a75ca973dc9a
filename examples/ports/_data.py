"""Synthetic data of the ported programs, from numpy seeds (no JAX, no torch).

The originals draw with ``torch.randn``/``random`` or download MNIST/ImageNet-sized
inputs; the ports and their torch twins read these instead, so both see the same
batches.
"""

from __future__ import annotations

import numpy as np


def toy_batch(rank: int, step: int, size: int = 20):
    """ddp/example.py: one rank's (inputs (size, 10), labels (size, 5)) of one step."""
    rs = np.random.RandomState(1000 * rank + step)
    return rs.randn(size, 10).astype(np.float32), rs.randn(size, 5).astype(np.float32)


def tutorial_dataset(size: int = 2048, seed: int = 0):
    """ddp-tutorial-series ``MyTrainDataset``: ``size`` pairs (x in [0,1)^20, y in [0,1))."""
    rs = np.random.RandomState(seed)
    return rs.rand(size, 20).astype(np.float32), rs.rand(size, 1).astype(np.float32)
