"""Forming a world: the store every worker meets at, and the checks made there.

Before torch's RPC agent starts, every worker writes its claim to the store
and reads everyone else's, so that a bad world fails with a clear error
instead of a hang::

    worker r                       store (hosted by rank 0, the driver or torchrun)
      |--- add claim/r ------------->|   a rank taken twice   -> RendezvousError
      |--- set world/r, name/r ----->|
      |<-- wait world/0..N-1 --------|   a missing peer       -> RendezvousError
      |    compare                   |   other world size     -> WorldSizeMismatchError
      |                              |   a name seen twice    -> DuplicateNameError
      `--> rpc.init_rpc(init_method="asyncrpc-store://") reuses the same store
           (the scheme is registered with torch while a world runs: _torch.install)
"""

from __future__ import annotations

import collections
import datetime
import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

from ._errors import DuplicateNameError, RendezvousError, WorldSizeMismatchError
from ._net import listen_on
from ._torch import PrefixStore, Store, TCPStore

__all__ = [
    "HANDOFF_URL",
    "agree",
    "client_store",
    "hand_off",
    "handoff_handler",
    "host_store",
]

HANDOFF_URL = "asyncrpc-store://"
_POLL_S = 0.02
_generation = itertools.count()
_handoff: dict[str, Any] = {}
_handoff_lock = threading.Lock()


def host_store(host: str, port: int, timeout: float) -> TCPStore:
    """Start the store's server on `host:port` only (port 0: a free one)."""
    sock = listen_on(host, port)
    bound_port = sock.getsockname()[1]
    # The store takes the descriptor over and closes it when it is destroyed.
    return TCPStore(
        host,
        bound_port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )


def client_store(host: str, port: int, timeout: float) -> TCPStore:
    """Connect to a store hosted elsewhere, retrying until `timeout`."""
    try:
        return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, TimeoutError) as exc:
        raise RendezvousError(
            f"could not reach the rendezvous store at {host}:{port} within {timeout:g} s "
            f"({exc}); check MASTER_ADDR/MASTER_PORT and that rank 0 has started"
        ) from exc


def agree(
    store: Store, rank: int, world_size: int, name: str, timeout: float, tag: str = ""
) -> tuple[str, ...]:
    """Meet every peer in `store`; return all names in rank order, or raise."""
    space = PrefixStore(f"asyncrpc/{tag}{next(_generation)}/", store)
    if space.add(f"claim/{rank}", 1) > 1:
        raise RendezvousError(
            f"rank {rank} was claimed by two processes; give every process its own rank "
            f"(0..{world_size - 1})"
        )
    space.set(f"name/{rank}", name)
    space.set(f"world/{rank}", str(world_size))
    # Rank 0's size first: a worker that expects more peers than exist would
    # otherwise wait for them until the timeout.
    _wait_for_peers(space, rank, [0], world_size, timeout)
    _check_sizes(space, rank, [0], world_size)
    _wait_for_peers(space, rank, range(world_size), world_size, timeout)
    _check_sizes(space, rank, range(world_size), world_size)
    names = tuple(space.get(f"name/{r}").decode() for r in range(world_size))
    _check_unique(names)
    return names


def _check_sizes(space: Store, rank: int, ranks: Iterable[int], world_size: int) -> None:
    sizes = {r: int(space.get(f"world/{r}")) for r in ranks}
    if any(size != world_size for size in sizes.values()):
        raise WorldSizeMismatchError(
            f"workers disagree on the world size: this one (rank {rank}) has "
            f"world_size={world_size}, but rank(s) report {sizes}; start every worker "
            f"with the same world_size (or the same WORLD_SIZE / --nproc-per-node)"
        )


def _wait_for_peers(
    space: Store, rank: int, ranks: Iterable[int], world_size: int, timeout: float
) -> None:
    keys = [f"world/{r}" for r in ranks]
    deadline = time.monotonic() + timeout
    while not _check(space, keys, rank):
        if time.monotonic() > deadline:
            missing = [r for r in ranks if not space.check([f"world/{r}"])]
            raise RendezvousError(
                f"rank {rank} waited {timeout:g} s but ranks {missing} of a world of "
                f"{world_size} never joined; start all {world_size} workers with the same "
                f"MASTER_ADDR/MASTER_PORT, or lower world_size"
            )
        time.sleep(_POLL_S)


def _check(space: Store, keys: list[str], rank: int) -> bool:
    try:
        return bool(space.check(keys))
    except dist.DistNetworkError as exc:
        raise RendezvousError(
            f"rank {rank} lost the rendezvous store while waiting for its peers ({exc}); "
            f"the process hosting it (rank 0 or the launcher) has probably exited: see "
            f"its error"
        ) from exc


def _check_unique(names: tuple[str, ...]) -> None:
    counts = collections.Counter(names)
    twice = sorted(name for name, n in counts.items() if n > 1)
    if twice:
        ranks = {name: [r for r, n in enumerate(names) if n == name] for name in twice}
        raise DuplicateNameError(
            f"worker names must be unique, but {ranks} share a name; pass a distinct "
            f"name= to each worker, or leave name unset for worker{{rank}}"
        )


def handoff_handler(url: str, **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    """torch's rendezvous handler for `asyncrpc-store://` (registered while a world runs)."""
    with _handoff_lock:
        store, rank, world_size = _handoff.pop("world")
    yield store, rank, world_size


def hand_off(store: Store, rank: int, world_size: int) -> str:
    """Make `store` the next one torch's `init_rpc` rendezvous returns; give its URL."""
    with _handoff_lock:
        _handoff["world"] = (store, rank, world_size)
    return HANDOFF_URL
