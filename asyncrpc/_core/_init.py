"""`init`: join a world from this process, with what the launcher's environment says.

Everything `init` is not told it reads from the environment a launcher
sets (torchrun, asyncrpc-launch, SLURM recipes), checks, and hands to
`_world.start`::

    init(rank?, world_size?, master_addr?, master_port?, **options)
      RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE
      ──> checked (a rank in range, sizes that agree, a port) ──> _world.start
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import _environ
from ._context import Context, Settings, names_for, resolve_world_size
from ._errors import WorldSizeMismatchError
from ._membership import Joining
from ._world import start

__all__ = ("init",)


def init(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    name: str | None = None,
    roles: Mapping[str, int] | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    joining: Joining | None = None,
    **options: Any,
) -> Context:
    """Join an RPC world from this process and return its `Context`.

    Missing values come from the launcher's environment (`RANK`, `WORLD_SIZE`,
    `MASTER_ADDR`, `MASTER_PORT`). Without a launcher, rank 0 hosts the
    rendezvous store on `master_addr:master_port` (default 127.0.0.1: loopback
    only). Options: see `Settings`. `joining` is how `asyncrpc-launch --restart
    worker` has its workers join a world that heals; leave it out. Example, in
    each of two processes::

        with asyncrpc.init(rank=r, world_size=2, master_port=29600) as ctx:
            print(asyncrpc.rpc_sync(ctx.names[1 - r], str.upper, args=("hi",)))
    """
    settings = Settings.from_options(options)
    rank = rank if rank is not None else _environ.from_env("RANK")
    if rank is None:
        raise ValueError("init() needs rank=..., or a RANK environment variable")
    env_world = _environ.from_env("WORLD_SIZE")
    asked = resolve_world_size(world_size, roles)
    if joining is not None and 0 < joining.size <= rank:
        # Added to an elastic world: the program's size was checked as the world formed.
        asked = None
    if asked is not None and env_world is not None and asked != env_world:
        raise WorldSizeMismatchError(
            f"the program asks for world_size={asked} but the launcher started "
            f"WORLD_SIZE={env_world} workers; launch with --nproc-per-node {asked} "
            f"(per node), or drop world_size= to take the launcher's"
        )
    size = asked if asked is not None else env_world
    if size is None:
        raise ValueError("init() needs world_size=..., or a WORLD_SIZE environment variable")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in 0..{size - 1} for world_size={size}, got {rank}")
    addr = master_addr or os.environ.get("MASTER_ADDR") or _environ.LOOPBACK
    port = master_port if master_port is not None else _environ.from_env("MASTER_PORT")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    hosts = rank == 0 and not agent_store
    if port is None or (port == 0 and not hosts):
        raise ValueError(
            "init() needs master_port=..., or a MASTER_PORT environment variable: the "
            "port where rank 0 hosts the rendezvous store"
        )
    worker_name = name or names_for(size, roles)[rank]
    # `joining` (asyncrpc-launch --restart worker): a world that heals, where the
    # launchers watch the workers; a peer's death must not end this one.
    return start(
        rank, size, worker_name, addr, port, settings, roles=roles, hosts_store=hosts,
        watch_peers=joining is None, joining=joining,
    )  # fmt: skip
