"""Where `asyncrpc-dump` and `asyncrpc-top` find running worlds: a small file per worker.

While a worker is in a world, it keeps a file in the user's runtime folder
(`$XDG_RUNTIME_DIR/asyncrpc`, else `$TMPDIR/asyncrpc-<uid>` or
`/tmp/asyncrpc-<uid>`) that says how to reach the world's side channel: the
address of the world's store and the key prefix of the channel in it::

    worker ──start──> <folder>/127.0.0.1_29500_0.json  {address, prefix, name, pid, ...}
    worker ──end────> file removed
    asyncrpc-dump ──> every file whose process lives, grouped by address: the worlds

A file whose process has died (or is a zombie), or whose pid now belongs to
another process (pids are reused: the file records when its process
started), is stale: listing removes it.
The folder is the user's own (mode 0700); files are written whole, then
renamed into place.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import tempfile
import time
from typing import Any

__all__ = ["folder", "process_started", "register", "unregister", "worlds"]


def folder() -> pathlib.Path:
    """This user's folder of world registrations (made on first use)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        path = pathlib.Path(runtime) / "asyncrpc"
    else:
        path = pathlib.Path(tempfile.gettempdir()) / f"asyncrpc-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def register(address: str, prefix: str, rank: int, name: str, names: tuple[str, ...]) -> str:
    """Record this worker of the world at `address`; returns the file to remove at its end."""
    entry = {
        "address": address,
        "prefix": prefix,
        "rank": rank,
        "name": name,
        "names": list(names),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "process_started": process_started(os.getpid()),  # tells a reused pid apart
    }
    path = folder() / f"{address.replace(':', '_')}_{rank}_{os.getpid()}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(entry))
    partial.replace(path)
    return str(path)


def unregister(path: str) -> None:
    """Remove this worker's file (it may be gone already)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def worlds() -> dict[str, list[dict[str, Any]]]:
    """Running worlds on this machine: address -> its workers' entries, stale ones removed."""
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder().glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
        if not _alive(pid) or process_started(pid) != entry.get("process_started"):
            unregister(str(path))
            continue
        found.setdefault(str(entry["address"]), []).append(entry)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not this user's registration to judge
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc here: signal 0 said it exists


def process_started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc's starttime); None: unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
