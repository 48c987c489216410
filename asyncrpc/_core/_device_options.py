"""The shapes `devices` and `device_maps` may take, checked as a world's options are made.

`_devices` resolves them into each worker's devices and maps as the world
starts; this module only says whether they make sense, before any process
starts (`Settings`, `asyncrpc-launch --devices`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._errors import DeviceMapError

__all__ = ("check", "parse")

_SHAPES = (
    "'cuda' (one GPU per worker: cuda:(LOCAL_RANK % count)), 'cpu', 'cuda:K', a list of "
    "such devices, or a dict from worker name, role or rank to one of those"
)


def check(devices: Any, device_maps: Any) -> None:
    """Raise DeviceMapError for a `devices`/`device_maps` of the wrong shape, or CUDA missing.

    Run as the options are made, before any process starts.
    """
    specs = list(devices.values()) if isinstance(devices, Mapping) else [devices]
    for spec in specs:
        parse(spec)
    if device_maps is not None:
        _check_maps(device_maps)
    wants_cuda = any(parse(spec) for spec in specs) or bool(device_maps)
    if wants_cuda and not isinstance(devices, Mapping) and not torch.cuda.is_available():
        raise DeviceMapError(
            f"devices={devices!r} device_maps={device_maps!r} ask for CUDA, but torch here "
            f"has none (torch {torch.__version__}, torch.cuda.is_available() is False); "
            f"leave devices and device_maps out (asyncrpc-launch: --devices) to run on CPU"
        )


def parse(spec: Any) -> list[str]:
    """A worker's devices as torch names them ("cuda:0"); [] for CPU; "cuda" kept as is."""
    if spec is None or spec == "cpu":
        return []
    if spec == "cuda":
        return ["cuda"]
    if isinstance(spec, (str, int, torch.device)):
        return [_device(spec)]
    if isinstance(spec, Sequence) and spec and not isinstance(spec, (str, bytes)):
        return [_device(one) for one in spec]
    raise DeviceMapError(f"devices must be {_SHAPES}; got {spec!r}")


def _device(spec: Any) -> str:
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = f"cuda:{spec}"  # torch reads a bare index as the current accelerator's
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise DeviceMapError(f"devices must be {_SHAPES}; got {spec!r} ({exc})") from exc
    if device.type != "cuda" or device.index is None:
        raise DeviceMapError(
            f"devices name CUDA devices with their index ('cuda:0'), or 'cuda' for one per "
            f"worker, or 'cpu' for none; got {spec!r}"
        )
    return str(device)


def _check_maps(device_maps: Any) -> None:
    if not isinstance(device_maps, Mapping) or not all(
        isinstance(peer, str) and isinstance(mapping, Mapping)
        for peer, mapping in device_maps.items()
    ):
        raise DeviceMapError(
            f"device_maps must be torch's: a dict from a peer's name to a dict from this "
            f"worker's device to the peer's ({{'worker1': {{'cuda:0': 'cuda:1'}}}}); got "
            f"{device_maps!r}"
        )
    for mapping in device_maps.values():
        for pair in mapping.items():
            for one in pair:
                _device(one)
