"""Forming a world: the store every worker meets at, and the checks made there.

Before torch's RPC agent starts, every worker writes its claim to the store
and reads everyone else's, so that a bad world fails with a clear error
instead of a hang::

    worker r                       store (hosted by rank 0, the driver or torchrun)
      |--- add claim/r ------------->|   a rank taken twice   -> RendezvousError
      |--- set name/r, append ------>|
      |    claims "r:N "             |
      |<-- get claims (on a join) ---|   a missing peer       -> StoreTimeoutError
      |    compare (also while       |   other world size     -> WorldSizeMismatchError
      |    waiting)                  |   a name seen twice    -> DuplicateNameError
      |<-- multi_get name/0..N-1 ----|
      |--- add decided ------------->|   this worker holds its verdict
      `--> torch's agent starts on the same store: a static group's by
           `_torch.start_static`, a dynamic group's by rpc.init_rpc(init_method=
           "asyncrpc-store://") (the scheme is registered while a world runs: _torch.install)

A worker that hosts the store (rank 0 of `init`) and refuses the world stays
until every worker that joined has counted itself decided: leaving at once
would take the store away from peers still reading the same verdict, and
they would report a lost store instead of the named error.
"""

from __future__ import annotations

import collections
import datetime
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

from . import _polling, _runtime
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
_LINGER_S = 30.0  # the longest a refusing host waits for its peers to read the verdict
_SETTLE_S = 2.0  # ... and for a peer that never joins
_REACH_S = 1.0  # one look whether a store listens: a host that drops the connect


class Handoff:
    """The store `hand_off` gives torch's next `init_rpc` (a part of `_runtime`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.world: tuple[Store, int, int] | None = None


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


def client_store(host: str, port: int, timeout: float, reach: float | None = None) -> TCPStore:
    """Connect to a store hosted elsewhere: waiting until it listens (`reach` s, by default
    `timeout`), then torch's client, whose operations wait up to `timeout` s.

    The wait is asyncrpc's own (`_polling`), so it ends when it says and a signal
    reaches the program meanwhile: torch's connect retries in C++, for about twice
    its timeout, and takes no signal until it returns.
    """
    reach = timeout if reach is None else reach
    _polling.until(
        lambda: _listens(host, port),
        reach,
        f"the rendezvous store at {host}:{port} did not answer within {reach:g} s; check "
        f"MASTER_ADDR/MASTER_PORT and that rank 0 (or node 0's launcher) has started",
    )
    try:
        return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, TimeoutError) as exc:
        raise RendezvousError(
            f"could not reach the rendezvous store at {host}:{port} within {timeout:g} s "
            f"({exc}); check MASTER_ADDR/MASTER_PORT and that rank 0 has started"
        ) from exc


def _listens(host: str, port: int) -> bool:
    """Whether something accepts connections at host:port now."""
    try:
        with socket.create_connection((host, port), timeout=_REACH_S):
            return True
    except OSError:
        return False


def agree(
    store: Store,
    rank: int,
    world_size: int,
    name: str,
    timeout: float,
    tag: str = "",
    *,
    hosts: bool = False,
) -> tuple[str, ...]:
    """Meet every peer in `store`; return all names in rank order, or raise.

    `hosts`: this process hosts `store`; when the world is refused it stays
    until its peers have read the same verdict (at most `_LINGER_S`).
    """
    # The how-many-th world this rank forms on this store: a store that outlives
    # a world (torchrun's agent store) gets a fresh key space for the next one.
    generation = int(store.add(f"asyncrpc/{tag}joins/{rank}", 1)) - 1
    space = PrefixStore(f"asyncrpc/{tag}{generation}/", store)
    refused = True
    try:
        names = _meet(space, rank, world_size, name, timeout)
        refused = False
        return names
    finally:
        _decided(space, hosts and refused, world_size)


def _meet(space: Store, rank: int, world_size: int, name: str, timeout: float) -> tuple[str, ...]:
    if space.add(f"claim/{rank}", 1) > 1:
        raise RendezvousError(
            f"rank {rank} was claimed by two processes; give every process its own rank "
            f"(0..{world_size - 1})"
        )
    space.set(f"name/{rank}", name)
    # Every claim in one value too: a waiting worker reads who came, and the size each
    # expects, in one round trip (a key per rank took N per look: seconds at 128).
    space.append("claims", f"{rank}:{world_size} ")  # type: ignore[attr-defined]
    space.add("joined", 1)
    # Rank 0's size first: a worker that expects more peers than exist would
    # otherwise wait for them until the timeout.
    _wait_for_peers(space, rank, [0], world_size, timeout)
    _wait_for_peers(space, rank, range(world_size), world_size, timeout)
    keys = [f"name/{r}" for r in range(world_size)]
    names = tuple(b.decode() for b in space.multi_get(keys))
    _check_unique(names)
    return names


def _claims(space: Store) -> dict[int, int]:
    """The size each rank that came expects, by rank."""
    pairs = (claim.split(":") for claim in space.get("claims").decode().split())
    return {int(r): int(size) for r, size in pairs}


def _check_sizes(rank: int, sizes: dict[int, int], world_size: int) -> None:
    others = {r: size for r, size in sorted(sizes.items()) if size != world_size}
    if others:
        raise WorldSizeMismatchError(
            f"workers disagree on the world size: this one (rank {rank}) has "
            f"world_size={world_size}, but rank(s) report {others}; "
            f"start every worker with the same world_size (or the same WORLD_SIZE / "
            f"--nproc-per-node)"
        )


def _wait_for_peers(
    space: Store, rank: int, ranks: Iterable[int], world_size: int, timeout: float
) -> None:
    waiting = set(ranks)
    joined_seen = [-1]

    def all_came() -> bool:
        joined = _joined(space, rank)
        if joined != joined_seen[0]:  # someone came: look who, and what size it expects
            joined_seen[0] = joined
            claims = _claims(space)
            present = {r: size for r, size in claims.items() if r in waiting}
            # Compared while waiting: a peer that expects fewer workers may be the
            # last one that ever comes, and its size names the mistake.
            _check_sizes(rank, present, world_size)
            waiting.difference_update(present)
        return not waiting

    _polling.until(
        all_came,
        timeout,
        lambda: (
            f"rank {rank} waited {timeout:g} s but ranks {sorted(waiting)} of a world of "
            f"{world_size} never joined; start all {world_size} workers with the same "
            f"MASTER_ADDR/MASTER_PORT, or lower world_size"
        ),
    )


def _joined(space: Store, rank: int) -> int:
    try:
        return int(space.add("joined", 0))
    except dist.DistNetworkError as exc:
        raise RendezvousError(
            f"rank {rank} lost the rendezvous store while waiting for its peers ({exc}); "
            f"the process hosting it (rank 0 or the launcher) has probably exited: see "
            f"its error"
        ) from exc


def _decided(space: Store, linger: bool, world_size: int) -> None:
    """Count this worker decided; with `linger`, wait for the peers that joined to decide."""
    try:
        space.add("decided", 1)
        if linger:
            _linger(space, world_size)
    except dist.DistError:  # the store is gone: nobody is left to wait for
        return


def _linger(space: Store, world_size: int) -> None:
    # Done when every worker that any joined peer expects has decided; one that
    # never comes is waited for until no one has joined for _SETTLE_S.
    seen = {"joined": -1, "at": time.monotonic(), "expected": world_size}

    def settled() -> bool:
        joined, decided = int(space.add("joined", 0)), int(space.add("decided", 0))
        if joined != seen["joined"]:
            seen.update(joined=joined, at=time.monotonic())
            seen["expected"] = _expected(space, world_size, joined)
        if decided >= seen["expected"]:
            return True
        return decided >= joined and time.monotonic() - seen["at"] > _SETTLE_S

    _polling.within(settled, _LINGER_S)


def _expected(space: Store, world_size: int, joined: int) -> int:
    """The largest world size that any worker that joined expects."""
    return max([world_size, *_claims(space).values()]) if joined else world_size


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
    yield _take_handoff()  # torch keeps this generator: it must not hold the part


def _take_handoff() -> tuple[Store, int, int]:
    handoff = _runtime.part(Handoff)
    with handoff.lock:
        given, handoff.world = handoff.world, None
    if given is None:
        raise KeyError("world")  # no store was handed off
    return given


def hand_off(store: Store, rank: int, world_size: int) -> str:
    """Make `store` the next one torch's `init_rpc` rendezvous returns; give its URL."""
    handoff = _runtime.part(Handoff)
    with handoff.lock:
        handoff.world = (store, rank, world_size)
    return HANDOFF_URL
