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

__all__ = ("check", "check_count", "check_keys", "normal_maps", "parse", "wants_cuda")

_SHAPES = (
    "'cuda' (one GPU per worker: cuda:(LOCAL_RANK % count)), 'cpu', 'cuda:K', a list of "
    "such devices, or a dict from worker name, role or rank to one of those"
)


def check(devices: Any, device_maps: Any) -> None:
    """Raise DeviceMapError for a `devices`/`device_maps` of the wrong shape, or CUDA missing.

    Run as the options are made, before any process starts. A per-worker dict
    that gives some worker a GPU is checked where that worker starts (another
    machine may have one), or by `asyncrpc.run` (`_devices.check_embedded`).
    """
    if isinstance(devices, Mapping):
        for key, spec in devices.items():
            try:
                parse(spec)
            except DeviceMapError as exc:
                raise DeviceMapError(f"devices[{key!r}]: {exc}") from None
    uniform = [] if isinstance(devices, Mapping) else parse(devices)
    maps = normal_maps(device_maps)
    if (uniform or maps) and not torch.cuda.is_available():
        raise DeviceMapError(
            f"devices={devices!r} device_maps={device_maps!r} ask for CUDA, but torch here "
            f"has none (torch {torch.__version__}, torch.cuda.is_available() is False); "
            f"leave devices and device_maps out (asyncrpc-launch: --devices) to run on CPU"
        )
    check_count([*uniform, *(source for m in maps.values() for source in m)], "this machine")


def check_count(devices: Sequence[str], where: str) -> None:
    """DeviceMapError for a device past the GPUs torch sees here ("cuda" asks for any)."""
    count = torch.cuda.device_count() if devices else 0
    beyond = [one for one in devices if one != "cuda" and int(one.split(":")[1]) >= count]
    if beyond:
        raise DeviceMapError(
            f"{where} has {count} GPU(s), cuda:0..cuda:{count - 1}, and {beyond} is asked "
            f"for; name one of those, or 'cuda' for one per worker"
        )


def wants_cuda(devices: Any, device_maps: Any) -> bool:
    """Whether any worker is given a CUDA device (a CPU-only `devices` asks for none)."""
    specs = list(devices.values()) if isinstance(devices, Mapping) else [devices]
    return bool(normal_maps(device_maps)) or any(parse(spec) for spec in specs)


def check_keys(devices: Any, names: Sequence[str], roles: Sequence[str]) -> None:
    """DeviceMapError for a per-worker dict key that names no worker, role or rank."""
    if not isinstance(devices, Mapping):
        return
    known = [*names, *roles, *range(len(names))]
    unknown = [key for key in devices if isinstance(key, bool) or key not in known]
    if unknown:
        raise DeviceMapError(
            f"devices names {unknown!r}, which is no worker, role or rank of this world; "
            f"its keys must be among the names {list(names)}, the roles {list(roles)} or "
            f"the ranks 0..{len(names) - 1}"
        )


def parse(spec: Any) -> list[str]:
    """A worker's CUDA devices as torch names them ("cuda:0"); [] for CPU; "cuda" kept."""
    if spec is None or spec == "cpu" or (isinstance(spec, (list, tuple)) and not spec):
        return []
    if spec == "cuda" or (isinstance(spec, torch.device) and str(spec) == "cuda"):
        return ["cuda"]
    if isinstance(spec, (str, int, torch.device)) and not isinstance(spec, bool):
        return [one for one in [_device(spec, "devices")] if one != "cpu"]
    if isinstance(spec, (list, tuple)):
        found = [_device(one, "devices", listed=True) for one in spec]
        cuda = [one for one in found if one != "cpu"]  # the CPU needs no device of torch's
        if len(set(cuda)) != len(cuda):
            raise DeviceMapError(f"devices lists a device twice: {spec!r}; list each once")
        return cuda
    raise DeviceMapError(f"devices must be {_SHAPES}; got {spec!r}")


def _device(spec: Any, what: str, listed: bool = False) -> str:
    """`spec` as torch names a device: "cuda:K" (an index is a CUDA device), or "cpu"."""
    if isinstance(spec, bool) or not isinstance(spec, (str, int, torch.device)):
        raise DeviceMapError(f"{what} name devices as 'cuda:K' or 'cpu'; got {spec!r}")
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        spec = f"cuda:{spec}"  # torch reads a bare index as the current accelerator's
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        device = None
    if device is not None and device.type == "cpu" and what == "devices":
        return "cpu"
    if device is None or device.type != "cuda" or device.index is None or device.index < 0:
        one_each = "" if listed or what != "devices" else ", or 'cuda' for one per worker"
        cpu = ", or 'cpu' for none" if what == "devices" else " (maps move CUDA tensors only)"
        raise DeviceMapError(
            f"{what} name CUDA devices with their index ('cuda:0'){one_each}{cpu}; got {spec!r}"
        )
    return str(device)


def normal_maps(device_maps: Any) -> dict[str, dict[str, str]]:
    """`device_maps` checked and in torch's device names; DeviceMapError saying what is wrong.

    Peers with an empty map are left out (they ask for nothing).
    """
    if device_maps is None:
        return {}
    if not isinstance(device_maps, Mapping) or not all(
        isinstance(peer, str) and isinstance(mapping, Mapping)
        for peer, mapping in device_maps.items()
    ):
        raise DeviceMapError(
            f"device_maps must be torch's: a dict from a peer's name to a dict from this "
            f"worker's device to the peer's ({{'worker1': {{'cuda:0': 'cuda:1'}}}}); got "
            f"{device_maps!r}"
        )
    maps = {}
    for peer, mapping in device_maps.items():
        pairs = {_device(a, "device_maps"): _device(b, "device_maps") for a, b in mapping.items()}
        if len(pairs) != len(mapping) or len(set(pairs.values())) != len(pairs):
            raise DeviceMapError(
                f"device_maps[{peer!r}] is not one to one ({dict(mapping)!r}): torch's maps "
                f"give each device one device of its own"
            )
        if pairs:
            maps[peer] = pairs
    return maps
