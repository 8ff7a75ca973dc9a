"""What a ported program and its torch twin share: numpy only (no JAX, no torch).

Synthetic data from numpy seeds (both programs read the same batches), initial weights
from an ``.npz`` state dict (``--init``; the tests write it from the torch model), and
the results file each rank writes (``--out``).
"""

from __future__ import annotations

import os
import pickle

import numpy as np


def save(out: str | None, rank: int, obj) -> None:
    """Write this rank's results to ``out/rank<rank>.pkl`` (nothing if ``out`` is None)."""
    if out:
        os.makedirs(out, exist_ok=True)
        tmp = os.path.join(out, f".rank{rank}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(obj, f)
        os.replace(tmp, os.path.join(out, f"rank{rank}.pkl"))


def load_init(path: str | None) -> dict[str, np.ndarray] | None:
    """A state dict saved with ``np.savez`` (torch names, torch layouts), or None."""
    if not path:
        return None
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def save_init(path: str, state_dict) -> str:
    """Save a torch ``state_dict`` (tensors) as ``.npz``, keys in their order."""
    np.savez(path, **{k: v.detach().cpu().numpy() for k, v in state_dict.items()})
    return path
