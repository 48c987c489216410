"""Whether this process's TensorPipe listener still accepts connections (a world that heals).

TensorPipe's listener reads a first message from every connection it
accepts. If one ends before it sent that message (a process killed as it
connected, or anything that connects to the port and closes), TensorPipe
marks the whole listener failed and closes its sockets; torch's agent logs
"encountered error when accepting incoming pipe" and never accepts again.
Pipes already open keep working, but no process can open a new one to this
worker, so no replacement can join a world that heals any more: every join
fails with ECONNREFUSED from a worker that is alive::

    peer: connect ──> (killed before its first message) ──> FIN
    this worker: accept ─> read first message ─> EOF ─> listener failed, closed
    a replacement: connect ─> ECONNREFUSED, on every try

torch cannot open a new listener for a running agent, so a world that
heals watches its own (`watch`): one thread checks, every `_CHECK_S`, that
the listening socket is still open in this process, and calls `closed`
once it is not (the world then restarts this worker, see `_healing`).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

from .. import _runtime
from ._agent import agent_running, agent_store, current_agent

__all__ = ("Listening", "find", "port", "unwatch", "watch")

_CHECK_S = 0.1  # between two checks of the listening socket
_CONFIRM_S = 0.2  # a closed socket seen while the agent runs: looked at again after this
_STOP_S = 2.0  # what the world's end waits for the thread


class Listening:
    """The watch of this worker's listener: its socket (fd, inode) and its thread."""

    __slots__ = ("__weakref__", "socket", "stopping", "thread")

    def __init__(self) -> None:
        self.socket: tuple[int, str] | None = None
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def close(self) -> None:
        """Stop the watch (before torch's agent closes the listener itself)."""
        self.stopping.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_S)


def port() -> int | None:
    """The TCP port torch's agent here listens on, or None where it cannot be told.

    torch publishes the agent's address in its store as "addrs/<name>"
    ("uv://host:port" for TensorPipe's TCP transport). None for another
    transport, or where /proc (Linux) is missing.
    """
    name = current_agent().get_worker_info().name
    try:
        address = agent_store().get(f"addrs/{name}").decode()
    except RuntimeError:
        return None
    if not address.startswith("uv://") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return int(address.rsplit(":", 1)[1])
    except ValueError:
        return None


def find(port: int) -> tuple[int, str] | None:
    """(fd, "socket:[inode]") of this process's socket listening on TCP `port`; None once closed.

    Looks at this process's own sockets only (a duplicate of each fd, asked
    for its port and whether it listens): /proc/net/tcp lists every socket
    of the host, thousands on a busy one.
    """
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                listens = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                if listens and sock.getsockname()[1] == port:
                    return int(name), link
        except OSError:  # closed meanwhile, or not a socket Python can wrap
            continue
    return None


def _open(listening: tuple[int, str] | None) -> bool:
    if listening is None:
        return False
    fd, link = listening
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == link
    except OSError:
        return False


def watch(closed: Callable[[], None]) -> bool:
    """Watch this worker's listener until the world ends; `closed()` once it stopped listening.

    Called on the watch's own thread, at most once, only while torch's agent
    still runs (also when the listener was closed before the watch began).
    False where the listener cannot be told (`port`): nothing watched.
    """
    listening = _runtime.part(Listening)
    listens_on = port()
    if listens_on is None or listening.thread is not None:
        return False
    found = listening.socket = find(listens_on)
    listening.thread = threading.Thread(
        target=_run, args=(listening, found, closed), name="asyncrpc-listener-watch", daemon=True
    )
    listening.thread.start()
    return True


def _run(listening: Listening, found: tuple[int, str] | None, closed: Callable[[], None]) -> None:
    while _open(found):
        if listening.stopping.wait(_CHECK_S):
            return
    # The agent closes its listener when it stops, too: only a listener gone
    # while the agent still runs, and the world has not begun to end, counts.
    if listening.stopping.wait(_CONFIRM_S) or not agent_running():
        return
    closed()


def unwatch() -> None:
    """Stop the watch of this worker's listener (a world that heals begins to end)."""
    _runtime.part(Listening).close()
