"""A static group's agent, started without torch's Gloo group: the world `run` and `init` form.

torch's `rpc.init_rpc(world_size=N)` builds a Gloo process group first (a
full mesh: N·(N-1) connections) only to gather every worker's device maps,
then runs a round of RPCs through rank 0 and a Gloo barrier. At 128
workers on 2 cores that took 3 s of a 9 s start. The agent itself needs
none of it: its own start meets the peers in the store (every rank's
name), and its `join` counts calls in the store. Here the device maps
cross the store in one round trip each, torch's own checks judge them, and
the agent starts as `init_rpc` would start it::

    worker r ── set devices/r = (name, device count, maps, devices) ──> store
             <─ multi_get devices/0..N-1 (waits for each) ──────────────
             torch's _validate_device_maps, _create_reverse_mapping, _create_device_list
             TensorPipeAgent(store, name, r, N, options, reverse maps, devices)
             (reads every rank's name from the store), started; autograd, profiler id

A world torch's own `init_rpc` started (adopted) is untouched by this.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.rpc import api as _rpc_api
from torch.distributed.rpc import backend_registry as _backends

from ._agent import PrefixStore, Store

__all__ = ("start_static",)


def start_static(
    store: Store, name: str, rank: int, world_size: int, options: rpc.TensorPipeRpcBackendOptions
) -> None:
    """Start torch's TensorPipe agent for rank `rank` of a static group of `world_size`.

    `store`: the world's (a PrefixStore of its own per attempt); its timeout
    becomes the RPC timeout, as `init_rpc` sets it. Example::

        start_static(PrefixStore("asyncrpc/0/rpc/", store), "worker1", 1, 4, options)
    """
    store.set_timeout(datetime.timedelta(seconds=options.rpc_timeout))
    reverse_maps, devices = _exchange_devices(PrefixStore("devices/", store), name, rank,
                                              world_size, options)  # fmt: skip
    if torch.cuda.is_available() and devices:
        # As torch's own start: a peer may send CUDA tensors before this process uses CUDA.
        torch.cuda.init()  # type: ignore[no-untyped-call]
    dist_autograd._init(rank)  # type: ignore[attr-defined]
    rpc._set_profiler_node_id(rank)  # type: ignore[attr-defined]
    agent = rpc.TensorPipeAgent(  # type: ignore[attr-defined]
        PrefixStore("agent/", store), name, rank, world_size, options, reverse_maps, devices
    )
    _rpc_api._init_rpc_states(agent)  # type: ignore[no-untyped-call]


def _exchange_devices(
    space: Store, name: str, rank: int, world_size: int, options: rpc.TensorPipeRpcBackendOptions
) -> tuple[dict[str, dict[torch.device, torch.device]], list[torch.device]]:
    """Every worker's device maps, checked as torch checks them; this worker's share."""
    maps = {peer: dict(m) for peer, m in options.device_maps.items()}
    mine = (name, torch.cuda.device_count(), maps, list(options.devices))
    space.set(str(rank), pickle.dumps(mine))  # type: ignore[arg-type]  # bytes are taken
    gathered = [pickle.loads(b) for b in space.multi_get([str(r) for r in range(world_size)])]
    names = [n for n, _, _, _ in gathered]
    counts = {n: count for n, count, _, _ in gathered}
    all_maps = {n: m for n, _, m, _ in gathered}
    all_devices = {n: d for n, _, _, d in gathered}
    _backends._validate_device_maps(names, counts, all_maps, all_devices)  # type: ignore[no-untyped-call]
    reverse = _backends._create_reverse_mapping(name, names, all_maps)  # type: ignore[no-untyped-call]
    devices = _backends._create_device_list(mine[3], maps, reverse)  # type: ignore[no-untyped-call]
    return reverse, devices
