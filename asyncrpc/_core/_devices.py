"""Which CUDA devices each worker uses, and the device maps between them (`devices=`).

torch moves a CUDA tensor between workers only along TensorPipe's device
maps: one to one per destination, the reply along the inverse. A world
asyncrpc starts builds them from `devices`, exchanged through its store
before torch's agent starts (every worker takes part, CPU ones too)::

    worker i:  devices="cuda" -> cuda:(LOCAL_RANK % device_count), torch.cuda.set_device
       │  store: asyncrpc/<tag>/devices/<name> = "cuda:1"    ("" on a CPU-only worker)
       ▼
    each GPU worker reads every name's, then, for each peer with a GPU,
       device_maps[peer] = {"cuda:i": "cuda:j"} (itself too)
       └──> TensorPipeRpcBackendOptions(device_maps=...): torch derives the devices

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
from ._device_options import check, check_count, check_keys, normal_maps, parse, wants_cuda
from ._environ import RESTART_VARIABLE
from ._errors import DeviceMapError, RendezvousError
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


def check_embedded(
    devices: Any, device_maps: Any, names: Sequence[str], roles: Sequence[str]
) -> None:
    """An embedded world's `devices` and `device_maps`, checked before its processes start.

    Every worker of `asyncrpc.run` runs on this machine: a worker given CUDA
    where torch has none, or a GPU past its count, is refused here, at once;
    so is a map to a peer that is no worker.
    """
    unknown = sorted(set(normal_maps(device_maps)) - set(names))
    if unknown:
        raise DeviceMapError(
            f"device_maps maps to {unknown}, which is no worker of this world; its keys "
            f"must be among {list(names)}"
        )
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
    check_count([one for spec in asking.values() for one in parse(spec)], "this machine")


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
    check_count(parse(devices), f"--devices {devices}: this machine")
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
    if parsed == ["cuda"]:
        local = int(os.environ.get("LOCAL_RANK", ctx.rank))
        parsed = [f"cuda:{local % torch.cuda.device_count()}"]
    check_count(parsed, f"worker {ctx.name!r}'s machine")
    return parsed


def resolve(
    devices: Any, device_maps: Any, ctx: Context, store: Store, tag: str, dynamic: bool,
    timeout: float,
) -> dict[str, dict[str, str]] | None:  # fmt: skip
    """The `device_maps` for this worker's TensorPipe options; None where it has none.

    Every worker says its devices in the store ("" for none), so a GPU peer
    never waits for one that was given none. torch derives each worker's
    device list from the maps and their inverses (its default), so a peer's
    map to a device of this worker is never refused for a list it lacks.
    `dynamic`: a world whose members change (it heals or grows): it refuses CUDA.
    """
    if devices is None:
        devices = os.environ.get(VARIABLE) or None
    check(devices, device_maps)
    if dynamic or os.environ.get(RESTART_VARIABLE) == "worker":
        refuse_changing(devices, device_maps)
    mine = own(devices, ctx)
    if mine:
        torch.cuda.set_device(mine[0])
    space = PrefixStore(f"asyncrpc/{tag}/devices/", store)
    space.set(ctx.name, ",".join(mine))
    maps = {} if not mine else _maps(mine[0], ctx, space, timeout)
    for peer, given in normal_maps(device_maps).items():
        made = maps.get(peer, {})
        merged = {**made, **given}
        # The map to itself (made) is kept beside a given one where both fit one to
        # one: `run` gives every worker the same device_maps, made for another's device.
        one_to_one = len(set(merged.values())) == len(merged)
        maps[peer] = merged if peer == ctx.name and one_to_one else given
    return maps or None


def _maps(first: str, ctx: Context, space: Store, timeout: float) -> dict[str, dict[str, str]]:
    """This worker's first device mapped to each GPU peer's first (every peer's, read).

    Itself included: torch sends a call to its own worker through its agent too,
    along the map to its own name.
    """
    peers = [name for name in ctx.names if name != ctx.name]
    try:
        wait_keys(space, peers, timeout)
    except RendezvousError as exc:
        missing = [peer for peer in peers if not space.check([peer])]
        raise RendezvousError(
            f"{missing} did not say their devices within {timeout} s: they did not start, "
            f"or run an asyncrpc older than this worker's"
        ) from exc
    maps = {ctx.name: {first: first}}
    for peer in peers:
        theirs = space.get(peer).decode()
        if theirs:
            maps[peer] = {first: theirs.split(",")[0]}
    return maps
