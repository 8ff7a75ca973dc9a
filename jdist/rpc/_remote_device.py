"""``remote_device`` strings: torch's ``"worker/device"`` / ``"rank:R/device"`` rules.

The caller parses and checks the string (torch's texts: ``Could not parse
remote_device: ...`` as ``ValueError``, a bad device string as ``RuntimeError``); the
owner maps the device part to one of its local JAX devices (:func:`local_device`), and
raises ``RuntimeError`` naming its devices when there is no such device (torch's
``invalid device ordinal``) instead of placing the module elsewhere.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["DEVICE_TYPES", "check_device", "local_device", "parse_remote_device"]

# the device types a jdist worker can map to a JAX platform (torch knows more: the
# others are refused by name, not silently put on the default device)
DEVICE_TYPES = ("cpu", "cuda", "gpu", "tpu")
_PLATFORM = {"cuda": "gpu"}
_DEVICE = re.compile(r"([a-zA-Z_]+)(?::(0|[1-9][0-9]*))?")


def check_device(device: str) -> str:
    """torch.device's rules for a device string; returns it normalized (``"cpu"``).

    Raises:
      RuntimeError: empty, malformed (``Invalid device string: 'cpu2'``) or an unknown
        type (``Expected one of cpu, cuda, ... device type at start of device
        string: foo``).
    """
    if not device:
        raise RuntimeError("Device string must not be empty")
    m = _DEVICE.fullmatch(device)
    if m is None:
        raise RuntimeError(f"Invalid device string: '{device}'")
    if m.group(1) not in DEVICE_TYPES:
        raise RuntimeError(f"Expected one of {', '.join(DEVICE_TYPES)} device type at start "
                           f"of device string: {device}")
    return device


def _is_device(text: str) -> bool:
    try:
        check_device(text)
    except RuntimeError:
        return False
    return True


def parse_remote_device(remote_device: Any) -> tuple[Any, str]:
    """``(worker, device)`` of torch's ``remote_device``: worker is a name, a rank or
    a WorkerInfo; device defaults to ``"cpu"`` as in torch.

    Raises:
      ValueError: not ``'<workername>/<device>'`` or ``'rank:<rank>/<device>'``.
      RuntimeError: a bad device part (see :func:`check_device`).
      TypeError: neither a string, a rank nor a WorkerInfo.
    """
    if isinstance(remote_device, int) and not isinstance(remote_device, bool):
        return remote_device, "cpu"
    if hasattr(remote_device, "name") and hasattr(remote_device, "id"):  # a WorkerInfo
        return remote_device, "cpu"
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}; expected "
                        "'worker/device', 'rank:R/device', a rank or a WorkerInfo")
    error = (f"Could not parse remote_device: {remote_device}. The valid format is "
             "'<workername>/<device>' or 'rank:<rank>/<device>'")
    fields = remote_device.split("/")
    if len(fields) == 2:
        worker, device = fields
    elif len(fields) == 1 and not _is_device(fields[0]):
        worker, device = fields[0], "cpu"
    elif len(fields) == 1:
        raise ValueError(f"{error}: {remote_device!r} names a device but no worker; a "
                         "RemoteModule lives on a worker, e.g. 'worker1/cpu'")
    else:
        raise ValueError(error)
    if not worker:
        raise ValueError(error)
    device = check_device(device)
    parts = worker.split(":")
    if len(parts) == 2:
        if parts[0] != "rank" or not parts[1].isdigit():
            raise ValueError(error)
        return int(parts[1]), device
    if len(parts) > 2:
        raise ValueError(error)
    return worker, device


def local_device(device: str) -> Any:
    """The local JAX device a device string names on this worker.

    Raises:
      RuntimeError: this worker has no such device (``invalid device ordinal``).
    """
    import jax

    kind, _, index = check_device(device).partition(":")
    platform = _PLATFORM.get(kind, kind)
    try:
        devices = jax.local_devices(backend=platform)
    except RuntimeError:
        devices = []
    i = int(index or 0)
    if i >= len(devices):
        raise RuntimeError(
            f"invalid device ordinal: {device!r} names {platform} device {i}, but this "
            f"worker has {len(devices)} local {platform} device(s) (its devices: "
            f"{jax.local_devices()}); name one of them, e.g. '<worker>/cpu'")
    return devices[i]
