"""What a world changes in its process, and puts back: environment variables, threads, gc.

Starting a world binds TensorPipe and Gloo to one network interface (by
environment variables they read as the agent starts), sets torch's intra-op
thread count where nothing else chose it, and may freeze the heap. Each
change is recorded in the world's `Changes` as it is made, and `put_back`
undoes them in reverse, for a failed start and for `shutdown` alike::

    start ──> bind_interface ──> TP_SOCKET_IFNAME, GLOO_SOCKET_IFNAME   (old values kept)
          ──> set_intra_op_threads ──> torch.set_num_threads            (old count kept)
          ──> gc.freeze()                                               (froze_gc)
    end   ──> put_back: each in reverse
"""

from __future__ import annotations

import dataclasses
import gc
import os
import socket

import torch

from . import _net
from ._errors import AsyncRPCError

__all__ = (
    "LOOPBACK",
    "NODE_VARIABLE",
    "RESTART_VARIABLE",
    "Changes",
    "bind_interface",
    "from_env",
    "put_back",
    "set_intra_op_threads",
    "single_node",
)

LOOPBACK = "127.0.0.1"
# asyncrpc-launch --elastic: the node whose launcher started this worker (its adds start there)
NODE_VARIABLE = "ASYNCRPC_NODE"
RESTART_VARIABLE = "ASYNCRPC_RESTART"  # asyncrpc-launch --restart: "world" or "worker"


@dataclasses.dataclass
class Changes:
    """What starting a world changed in this process, to be put back as it ends."""

    restore: list[tuple[str, str | None]] = dataclasses.field(default_factory=list)
    intra_op_before: int | None = None
    froze_gc: bool = False  # this world froze the heap (gc.freeze); its end thaws it


def from_env(key: str) -> int | None:
    """The integer in environment variable `key`; None when it is unset or empty."""
    raw = os.environ.get(key)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def single_node(master_addr: str, world_size: int) -> bool:
    """True when every worker of the world runs on this machine."""
    local = from_env("LOCAL_WORLD_SIZE")
    if local is not None:
        return local == world_size
    return _net.is_loopback(master_addr)


def _set_env(changes: Changes, key: str, value: str) -> None:
    changes.restore.append((key, os.environ.get(key)))
    os.environ[key] = value


def put_back(changes: Changes) -> None:
    """Undo what starting a world changed in this process."""
    for key, value in reversed(changes.restore):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    changes.restore.clear()
    if changes.intra_op_before is not None:
        torch.set_num_threads(changes.intra_op_before)
    if changes.froze_gc:
        gc.unfreeze()
        changes.froze_gc = False


def bind_interface(
    changes: Changes, master_addr: str, world_size: int, interface: str | None
) -> None:
    """Have TensorPipe and Gloo bind `interface` (or the one towards the master)."""
    # TensorPipe reads TP_SOCKET_IFNAME when the agent starts, and the Gloo group
    # that torch's agent set-up builds reads GLOO_SOCKET_IFNAME; without them each
    # binds the address the hostname resolves to, which may be the wrong network.
    chosen = interface or os.environ.get("ASYNCRPC_INTERFACE")
    if chosen is None and "TP_SOCKET_IFNAME" in os.environ:
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            _set_env(changes, "GLOO_SOCKET_IFNAME", os.environ["TP_SOCKET_IFNAME"])
        return
    if chosen is None:
        if single_node(master_addr, world_size):
            chosen = _net.interface_for(LOOPBACK)
        else:
            chosen = _net.interface_for(_net.local_address_towards(master_addr, 0))
    if chosen is None:
        raise AsyncRPCError(
            f"could not find the network interface to bind for master {master_addr!r}; "
            f"pass interface='eth0' (or set ASYNCRPC_INTERFACE) with the interface name"
        )
    if chosen not in {n for _, n in socket.if_nameindex()}:
        raise ValueError(
            f"interface {chosen!r} does not exist on this host; choose one of "
            f"{sorted(n for _, n in socket.if_nameindex())}"
        )
    _set_env(changes, "TP_SOCKET_IFNAME", chosen)
    _set_env(changes, "GLOO_SOCKET_IFNAME", chosen)


def set_intra_op_threads(changes: Changes, wanted: int | None, world_size: int) -> None:
    """Set torch's intra-op threads, unless the environment chose them.

    First of: `intra_op_threads=`, ASYNCRPC_INTRA_OP_THREADS, OMP_NUM_THREADS
    (set by the user or a launcher: torch read it when it started, and the
    count is left alone), cores // local workers (at least 1).
    """
    if wanted is None:
        wanted = from_env("ASYNCRPC_INTRA_OP_THREADS") or None
    if wanted is None and os.environ.get("OMP_NUM_THREADS", "").strip():
        return
    if wanted is None:
        local = from_env("LOCAL_WORLD_SIZE") or world_size
        wanted = max(1, len(os.sched_getaffinity(0)) // max(1, local))
    changes.intra_op_before = torch.get_num_threads()
    torch.set_num_threads(wanted)
