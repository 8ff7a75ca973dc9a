"""Batches as numpy, for loaders that would otherwise make torch tensors.

``numpy_collate`` is a ``collate_fn`` for ``torch.utils.data.DataLoader`` that stacks
samples into numpy arrays (no torch tensor is made, so DDP's ``device_put`` reads the
stacked array directly). ``to_numpy`` turns a batch that torch's default collate already
made into numpy views of the same memory (no copy). Neither imports torch: a torch
tensor is recognised by its type's module and asked for ``.numpy()``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["numpy_collate", "to_numpy", "batch_rows"]


def _is_torch_tensor(x) -> bool:
    return type(x).__module__.partition(".")[0] == "torch" and hasattr(x, "numpy")


def _leaf(x):
    if isinstance(x, np.ndarray):
        return x
    if _is_torch_tensor(x):
        return x.numpy(force=True)  # a view for CPU tensors without grad; copies otherwise
    return np.asarray(x)


def numpy_collate(samples):
    """Stack a list of samples into one batch of numpy arrays (a ``collate_fn``).

    Samples may be numpy arrays, numbers, torch tensors, or dicts / tuples / lists /
    namedtuples of those (nested); the batch has the same structure with a new leading
    dimension. Strings and bytes are kept as lists.

    Raises:
      ValueError: ``samples`` is empty, or samples disagree in structure or shape (the
        message names the path of the leaf and the shapes seen).

    Examples:
      >>> b = numpy_collate([{"x": np.zeros(3), "y": 1}, {"x": np.ones(3), "y": 2}])
      >>> b["x"].shape, b["y"].tolist()
      ((2, 3), [1, 2])
    """
    samples = list(samples)
    if not samples:
        raise ValueError("numpy_collate got no samples; a batch needs at least one")
    return _collate(samples, "batch")


def _collate(samples: list, path: str):
    first = samples[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for s in samples:
            if not isinstance(s, Mapping) or list(s) != keys:
                raise ValueError(
                    f"{path}: samples have different keys ({keys} and "
                    f"{list(s) if isinstance(s, Mapping) else type(s).__name__}); every "
                    "sample of a batch needs the same structure"
                )
        return {k: _collate([s[k] for s in samples], f"{path}[{k!r}]") for k in keys}
    if isinstance(first, (str, bytes)):
        return list(samples)
    if isinstance(first, (tuple, list)):
        for s in samples:
            if type(s) is not type(first) or len(s) != len(first):
                raise ValueError(
                    f"{path}: samples have different structures ({type(first).__name__} "
                    f"of {len(first)} and {type(s).__name__} of "
                    f"{len(s) if hasattr(s, '__len__') else '?'}); every sample of a "
                    "batch needs the same structure"
                )
        parts = [_collate([s[i] for s in samples], f"{path}[{i}]") for i in range(len(first))]
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*parts)
        return type(first)(parts)
    leaves = [_leaf(s) for s in samples]
    shapes = {x.shape for x in leaves}
    if len(shapes) > 1:
        raise ValueError(
            f"{path}: samples have different shapes {sorted(shapes)}; pad or crop them to "
            "one shape in the dataset (or pass a collate_fn that pads)"
        )
    return np.stack(leaves)


def to_numpy(batch):
    """The same batch with every torch tensor as a numpy array sharing its memory.

    For batches from torch's default collate (with workers, torch puts them in shared
    memory; the numpy views keep it alive). Other leaves are left as they are.
    """
    if isinstance(batch, Mapping):
        return {k: to_numpy(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_numpy(v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_numpy(v) for v in batch)
    if _is_torch_tensor(batch):
        return batch.numpy(force=True)
    return batch


def batch_rows(batch) -> int:
    """The number of samples in ``batch``: the leading size of its first leaf."""
    x = batch
    while True:
        if isinstance(x, Mapping):
            if not x:
                raise ValueError("a batch is an empty dict; it has no samples to count")
            x = next(iter(x.values()))
        elif isinstance(x, (tuple, list)) and not isinstance(x, (str, bytes)):
            if not x:
                raise ValueError("a batch is an empty sequence; it has no samples to count")
            if not hasattr(x[0], "shape") and not isinstance(x[0], (Mapping, tuple, list)):
                return len(x)  # a list of plain values (strings, numbers)
            x = x[0]
        else:
            shape = getattr(x, "shape", None)
            if shape is None or len(shape) == 0:
                raise ValueError(
                    f"cannot count the samples of a batch whose first leaf is "
                    f"{type(x).__name__} {getattr(x, 'shape', '')}; batches need a leading "
                    "batch dimension"
                )
            return int(shape[0])
