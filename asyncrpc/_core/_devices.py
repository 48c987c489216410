"""Which CUDA devices each worker uses, and the device maps between them (`devices=`).

torch moves a CUDA tensor between workers only along TensorPipe's device
maps: one to one per destination, the reply along the inverse. A world
asyncrpc starts builds them from `devices`, exchanged through its store
before torch's agent starts (every worker takes part, CPU ones too)::

    worker i:  devices="cuda" -> cuda:(LOCAL_RANK % device_count), torch.cuda.set_device
       │  store: asyncrpc/<tag>/devices/<name> = "cuda:1"    ("" on a CPU-only worker)
       ▼
    each GPU worker reads every name's, then, for each peer with a GPU,
       device_maps[peer] = {"cuda:i": "cuda:j"} (itself too); devices = ["cuda:i"]
       └──> TensorPipeRpcBackendOptions(devices=..., device_maps=...)

`device_maps` given by the program are torch's own, taken as they are (they
replace the made map for the peers they name). Each GPU worker maps its
device to itself as well: torch sends a call to its own name through its
agent. A CUDA tensor sent where no map leads fails as `DeviceMapError`
(`_failures`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._context import Context
from ._device_options import check, check_keys, parse, wants_cuda
from ._environ import RESTART_VARIABLE
from ._errors import DeviceMapError
from ._records import wait_keys
from ._torch import PrefixStore, Store

__all__ = (
    "VARIABLE",
    "check",
    "check_embedded",
    "check_flag",
    "check_keys",
    "own",
    "refuse_changing",
    "resolve",
    "wants_cuda",
)

VARIABLE = "ASYNCRPC_DEVICES"  # `asyncrpc-launch --devices`: the workers' `devices`


def refuse_changing(devices: Any, device_maps: Any) -> None:
    """DeviceMapError where a world whose members change gives a worker a GPU.

    torch fixes a member's maps as it joins: a peer that joins later is in
    none of them, so CUDA tensors could not reach it. CPU-only `devices`
    ("cpu") ask for nothing and pass.
    """
    if not wants_cuda(devices, device_maps):
        return
    raise DeviceMapError(
        f"devices={devices!r} device_maps={device_maps!r}: a world whose members change "
        f"(restart='worker', elastic=True, asyncrpc-launch --elastic) cannot map CUDA "
        f"devices yet (a member that joins later is in no earlier member's maps); start "
        f"it as a fixed world, or without devices"
    )


def check_embedded(devices: Any, names: Sequence[str], roles: Sequence[str]) -> None:
    """An embedded world's per-worker `devices`, checked before its processes start.

    Every worker of `asyncrpc.run` runs on this machine: a worker given CUDA
    where torch has none is refused here, at once, not as it starts.
    """
    if not isinstance(devices, Mapping):
        return
    check_keys(devices, names, roles)
    asking = {key: spec for key, spec in devices.items() if parse(spec)}
    if asking and not torch.cuda.is_available():
        raise DeviceMapError(
            f"devices gives {asking!r} CUDA, but torch here has none (torch "
            f"{torch.__version__}), and every worker of asyncrpc.run runs on this machine; "
            f"give them 'cpu', or leave devices out"
        )


def check_flag(devices: str, changing: bool) -> None:
    """`asyncrpc-launch --devices X`: DeviceMapError (a ValueError) naming the flag.

    `changing`: the launch makes a world whose members change (`--elastic`,
    `--restart worker`), which maps no CUDA devices.
    """
    try:
        cuda = wants_cuda(devices, None)
    except DeviceMapError as exc:
        raise DeviceMapError(
            f"--devices must be 'cuda' (one GPU per worker), 'cuda:K' or K (that GPU), or "
            f"'cpu'; got {devices!r}"
        ) from exc
    if cuda and not torch.cuda.is_available():
        raise DeviceMapError(
            f"--devices {devices} asks for CUDA, but torch here has none (torch "
            f"{torch.__version__}); leave --devices out to run on CPU"
        )
    if cuda and changing:
        raise DeviceMapError(
            f"--devices {devices} maps CUDA devices in a fixed world only; leave "
            f"--elastic, --join and --restart worker out, or --devices"
        )


def own(devices: Any, ctx: Context) -> list[str]:
    """This worker's devices: its entry of a per-worker dict, "cuda" made one GPU."""
    spec = devices
    if isinstance(devices, Mapping):
        check_keys(devices, ctx.names, [role for role, _ in ctx.roles])
        keys = (ctx.name, ctx.role, ctx.rank)
        spec = next((devices[key] for key in keys if key is not None and key in devices), None)
    parsed = parse(spec)
    if parsed and not torch.cuda.is_available():
        raise DeviceMapError(
            f"worker {ctx.name!r} is given devices {spec!r}, but torch here has no CUDA "
            f"(torch {torch.__version__}); give it 'cpu' in devices, or start it on a "
            f"machine with a GPU"
        )
    count = torch.cuda.device_count() if parsed else 0
    if parsed == ["cuda"]:
        local = int(os.environ.get("LOCAL_RANK", ctx.rank))
        parsed = [f"cuda:{local % count}"]
    beyond = [one for one in parsed if int(one.split(":")[1]) >= count]
    if beyond:
        raise DeviceMapError(
            f"worker {ctx.name!r} is given {beyond}, but this machine has {count} GPU(s), "
            f"cuda:0..cuda:{count - 1}; give it one of those, or 'cuda' for one per worker"
        )
    return parsed


def resolve(
    devices: Any, device_maps: Any, ctx: Context, store: Store, tag: str, dynamic: bool,
    timeout: float,
) -> tuple[list[str] | None, dict[str, dict[str, str]] | None]:  # fmt: skip
    """The `devices` and `device_maps` for this worker's TensorPipe options.

    (None, None) where the world asks for none (nothing exchanged). `dynamic`:
    a world whose members change (it heals or grows), which refuses them.
    """
    if devices is None:
        devices = os.environ.get(VARIABLE) or None
    if devices is None and device_maps is None:
        return None, None
    check(devices, device_maps)
    if dynamic or os.environ.get(RESTART_VARIABLE) == "worker":
        refuse_changing(devices, device_maps)
    mine = own(devices, ctx)
    if mine:
        torch.cuda.set_device(mine[0])
    space = PrefixStore(f"asyncrpc/{tag}/devices/", store)
    space.set(ctx.name, ",".join(mine))
    maps = {} if not mine else _maps(mine[0], ctx, space, timeout)
    maps.update({peer: {str(a): str(b) for a, b in m.items()} for peer, m in
                 (device_maps or {}).items()})  # fmt: skip
    listed = sorted(set(mine) | {a for m in maps.values() for a in m})
    return listed or None, maps or None


def _maps(first: str, ctx: Context, space: Store, timeout: float) -> dict[str, dict[str, str]]:
    """This worker's first device mapped to each GPU peer's first (every peer's, read).

    Itself included: torch sends a call to its own worker through its agent too,
    along the map to its own name.
    """
    peers = [name for name in ctx.names if name != ctx.name]
    wait_keys(space, peers, timeout, f"not every worker said its devices within {timeout} s")
    maps = {ctx.name: {first: first}}
    for peer in peers:
        theirs = space.get(peer).decode()
        if theirs:
            maps[peer] = {first: theirs.split(",")[0]}
    return maps
