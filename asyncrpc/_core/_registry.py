"""Where `asyncrpc-dump` and `asyncrpc-top` find running worlds: a small file per worker.

While a worker is in a world, it keeps a file in the user's runtime folder
(`$XDG_RUNTIME_DIR/asyncrpc`, else `$TMPDIR/asyncrpc-<uid>` or
`/tmp/asyncrpc-<uid>`) that says how to reach the world's side channel: the
address of the world's store and the key prefix of the channel in it::

    worker ──start──> <folder>/127.0.0.1_29500_0.json  {address, prefix, name, pid, ...}
                      (a world that heals adds {heal, queue, attempt}: see `Healing`)
    worker ──end────> file removed
    asyncrpc-dump ──> every file whose process lives, grouped by address: the worlds

A file whose process has died (or is a zombie), or whose pid now belongs to
another process (pids are reused: the file records when its process
started), is stale: listing removes it.
The folder is the user's own (mode 0700); files are written whole, then
renamed into place. The file only helps the commands find the world, so it
never stops one: where the runtime folder cannot be written (an
`XDG_RUNTIME_DIR` left from another user after `su`), the worker writes to
the next folder, and where none can be, it runs unregistered, saying so once
(one WARNING line per process). The commands look in every folder (in the
temporary one, with a runtime folder, for the workers that wanted that one).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket
import tempfile
import time
from typing import Any, NamedTuple

from . import _runtime

__all__ = ("Healing", "folder", "folders", "process_started", "register", "unregister", "worlds")

_logger = logging.getLogger("asyncrpc")


def folders() -> list[pathlib.Path]:
    """Where registrations go, first choice first: the runtime folder, then the temporary one."""
    found = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        found.append(pathlib.Path(runtime) / "asyncrpc")
    temporary = os.environ.get("TMPDIR")  # read each time: tempfile keeps its first answer
    if not (temporary and os.path.isdir(temporary)):
        temporary = tempfile.gettempdir()
    found.append(pathlib.Path(temporary) / f"asyncrpc-{os.getuid()}")
    return found


def folder() -> pathlib.Path:
    """This user's first folder of world registrations that can be written (made on first use).

    Raises `OSError` when none can be.
    """
    error: OSError | None = None
    for path in folders():
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            error = exc
            continue
        if os.access(path, os.W_OK | os.X_OK):
            return path
        error = PermissionError(f"{path} cannot be written")
    assert error is not None  # folders() always names one
    raise error


class Healing(NamedTuple):
    """A worker of a world that heals, as its registration records it.

    `prefix`: the key prefix of the members' records in the world's store
    (`id/<name>`: the torch id whose side-channel queue answers for a name,
    `attempt/<name>`: its attempt); `queue`, `attempt`: this process's.
    A replacement's queue is not its rank, so the commands read them there.
    """

    prefix: str
    queue: int
    attempt: int


def register(
    address: str,
    prefix: str,
    rank: int,
    name: str,
    names: tuple[str, ...],
    heal: Healing | None = None,
) -> str | None:
    """Record this worker of the world at `address`; returns the file to remove at its end.

    `heal`: in a world that heals, where its members are listed and this
    process's queue and attempt (see `Healing`). None where no folder can be
    written: the world runs unregistered (said once).
    """
    entry: dict[str, Any] = {
        "address": address,
        "prefix": prefix,
        "rank": rank,
        "name": name,
        "names": list(names),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "process_started": process_started(os.getpid()),  # tells a reused pid apart
        "runtime": os.environ.get("XDG_RUNTIME_DIR"),  # the folder it wanted (see `worlds`)
    }
    if heal is not None:
        entry.update(heal=heal.prefix, queue=heal.queue, attempt=heal.attempt)
    tried = []
    for place in folders():
        try:
            place.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = place / f"{address.replace(':', '_')}_{rank}_{os.getpid()}.json"
            partial = path.with_suffix(".tmp")
            partial.write_text(json.dumps(entry))
            partial.replace(path)
        except OSError as exc:
            tried.append(f"{place} ({exc.strerror or exc})")
            continue
        return str(path)
    _unregistered(tried)
    return None


def _unregistered(tried: list[str]) -> None:
    if _runtime.SLOT.warned_unregistered:
        return
    _runtime.SLOT.warned_unregistered = True
    _logger.warning(
        "this worker runs unregistered, so asyncrpc-dump and asyncrpc-top on this "
        "machine cannot find its world: no folder for its registration can be written (tried "
        "%s); set XDG_RUNTIME_DIR or TMPDIR to a folder of yours to have it found",
        "; ".join(tried),
    )


def unregister(path: str) -> None:
    """Remove this worker's file (it may be gone already)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def worlds() -> dict[str, list[dict[str, Any]]]:
    """Running worlds on this machine: address -> its workers' entries, stale ones removed.

    With a runtime folder, the temporary one adds the workers that wanted the
    same runtime folder and could not write there (after `su`); not others',
    which another XDG_RUNTIME_DIR keeps apart (a second session, a test).
    """
    found: dict[str, list[dict[str, Any]]] = {}
    places = folders()
    runtime = os.environ.get("XDG_RUNTIME_DIR") if len(places) > 1 else None
    for place in places:
        for path in _listed(place):
            try:
                entry = json.loads(path.read_text())
                pid = int(entry["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not ours
            if not _alive(pid) or process_started(pid) != entry.get("process_started"):
                unregister(str(path))
            elif runtime is None or place == places[0] or entry.get("runtime") == runtime:
                found.setdefault(str(entry["address"]), []).append(entry)
    return found


def _listed(place: pathlib.Path) -> list[pathlib.Path]:
    try:
        return sorted(place.glob("*.json"))
    except OSError:  # not ours to read
        return []


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
