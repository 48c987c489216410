"""Which running world a command looks at, and asking all its workers at once.

asyncrpc-dump [--world host:port]
  registrations (_core._registry) ── one world? ── yes ─> connect to its store
                                      │ none: exit 1, "no world is running"
                                      └ several, no --world: exit 2, listing them
  ask every rank through the side channel (_core._side) ─> answers, in rank order
  (in a world that heals, a replacement at its torch id: the store's heal/id/<name>)

A store whose process is stopped (SIGSTOP, Ctrl-Z in its terminal) still
accepts connections (the kernel queues them), but never answers, and torch's
client then waits forever: the asking runs on a thread of its own with a
deadline, and when it passes, the process is named from /proc::

    /proc/net/tcp{,6}: the socket listening on the store's port ── its inode
    /proc/<pid>/fd/*:  the process holding that socket            ── pid, state ("T": stopped)

On a machine without /proc, or for a store on another machine, the pid is unknown.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from .._core import _registry, _side

__all__ = (
    "Unreachable", "ask_world", "attempt_note", "is_stopped", "pick_world", "quiet_stderr",
    "run_command", "store_holder", "try_ask_world",
)  # fmt: skip

EXIT_NO_WORLD = 1
EXIT_WHICH_WORLD = 2


def pick_world(wanted: str | None) -> tuple[str, dict[str, Any]]:
    """(address, one registration of it) for `--world`, or the only world running."""
    worlds = _registry.worlds()
    if wanted is not None:
        if wanted not in worlds:
            _fail(
                EXIT_NO_WORLD,
                f"no running world has the rendezvous address {wanted!r}; " + _listing(worlds),
            )
        return wanted, worlds[wanted][0]
    if not worlds:
        _fail(
            EXIT_NO_WORLD,
            f"no asyncrpc world is running for this user on this machine (looked in "
            f"{' and '.join(map(str, _registry.folders()))}); start one, or run this on a "
            f"machine where one runs",
        )
    if len(worlds) > 1:
        _fail(EXIT_WHICH_WORLD, f"{len(worlds)} worlds are running: pick one with --world. "
              + _listing(worlds))  # fmt: skip
    address = next(iter(worlds))
    return address, worlds[address][0]


ANSWER_BY_S = 4.0  # from the command's start: it answers within 5 s, its start-up included
_SPARE_S = 0.4  # past the workers' time: for the store's own last answers


class Unreachable:
    """The world's store gave no answer: `reason` says why; `silent`: it took the call, no more."""

    def __init__(self, reason: str, silent: bool) -> None:
        self.reason, self.silent = reason, silent


def ask_world(
    address: str, entry: dict[str, Any], kind: str, blank: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every worker's answer to `kind`, in rank order; exits (status 1) if the store gives none.

    A worker that gives none within the command's time (`ANSWER_BY_S`) is
    `{name, rank, pid, host, "error"}` plus `blank`, the keys an answer
    would have; its pid and host are known when it registered on this machine.
    """
    workers = try_ask_world(address, entry, kind, blank)
    if isinstance(workers, Unreachable):
        _fail(EXIT_NO_WORLD, workers.reason)
    return workers


def try_ask_world(
    address: str, entry: dict[str, Any], kind: str, blank: dict[str, Any] | None = None
) -> list[dict[str, Any]] | Unreachable:
    """`ask_world`, or why the store gave no answer, always within the command's time.

    A store whose process is stopped takes connections and never answers, and
    torch's client then waits forever: the asking runs on a thread of its own,
    and a turn while the last one is still stuck waits for that one instead.
    """
    timeout = max(1.0, ANSWER_BY_S - _running_for())
    with quiet_stderr():  # torch's client logs a lost store with its C++ frames: said below
        stuck = _stuck.pop(address, None)
        if stuck is not None:  # the store answers again once this one ends; its answers are old
            stuck.thread.join(timeout + _SPARE_S)
        job = stuck if stuck is not None and stuck.thread.is_alive() else None
        if job is None:
            job = _Job(lambda: _ask_store(address, entry, kind, timeout))
            job.thread.join(timeout + _SPARE_S)
    if job.thread.is_alive() or (job.error is not None and is_stopped(store_holder(address))):
        if job.thread.is_alive():
            _stuck[address] = job
        reason = _silent_store(address, _registry.worlds().get(address, []), timeout)
        return Unreachable(reason, silent=True)
    if job.error is not None or job.answers is None:
        error = job.error or RuntimeError("no answer")
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return Unreachable(
            f"cannot reach the world's store at {address} ({first}); it may have just ended",
            silent=False,
        )
    return _workers(address, job.answers, timeout, blank)


class _Job:
    """One asking of the store, on a daemon thread (one stuck in torch's client ends with us)."""

    def __init__(self, ask: Any) -> None:
        self.answers: dict[int, tuple[str, dict[str, Any] | None, float | None]] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(ask,), daemon=True,
                                       name="asyncrpc-ask-world")  # fmt: skip
        self.thread.start()

    def _run(self, ask: Any) -> None:
        try:
            self.answers = ask()
        except Exception as exc:  # reported by the asker
            self.error = exc


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null meanwhile (torch's C++ log writes there, not to Python's)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_stuck: dict[str, _Job] = {}  # address -> the asking still waiting on its store


def _ask_store(
    address: str, entry: dict[str, Any], kind: str, timeout: float
) -> dict[int, tuple[str, dict[str, Any] | None, float | None]]:
    host, _, port = address.rpartition(":")
    # Nothing listening is said at once (torch's client would retry until its timeout).
    socket.create_connection((host.strip("[]"), int(port)), timeout=min(2.0, timeout)).close()
    store = _side.connect(address, entry["prefix"], timeout=min(2.0, timeout))
    members = _members(address, entry, timeout)
    answers = _side.ask(store, [queue for _, _, queue, _ in members], kind, timeout)
    return {rank: (name, answers[queue], joined) for rank, name, queue, joined in members}


def _members(
    address: str, entry: dict[str, Any], timeout: float
) -> list[tuple[int, str, int, float | None]]:
    """(rank, name, side-channel queue, when it joined) of each member now.

    The queue is the rank, but in a world that heals or grows: there a
    replacement's is its torch id, which the world's store keeps per name
    (`_records`); a name not recorded there yet is asked at its rank. The
    store also has the members added since the world started (with the time
    each joined) and those that left, which are not members.
    """
    found: list[tuple[int, str, int, float | None]] = []
    if not entry.get("heal"):
        return [(rank, name, rank, None) for rank, name in enumerate(entry["names"])]
    space = _side.connect(address, entry["heal"], timeout=min(2.0, timeout))
    names, left = entry["names"], set()
    if space.check(["names", "state"]):
        names = json.loads(space.get("names"))
        left = set(json.loads(space.get("state")).get("left", ()))
    for rank, name in enumerate(names):
        if name in left:
            continue
        queue, joined = rank, None
        if space.check([f"id/{name}"]):
            queue = int(space.get(f"id/{name}"))
        if space.check([f"joined/{name}"]) and rank >= len(entry["names"]):
            joined = float(space.get(f"joined/{name}"))
        found.append((rank, name, queue, joined))
    return found


def departures(address: str, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers that left the world (`remove_workers`): name, rank, when and why."""
    if not entry.get("heal"):
        return []
    try:
        with quiet_stderr():
            space = _side.connect(address, entry["heal"], timeout=1.0)
            names = json.loads(space.get("names")) if space.check(["names"]) else []
            gone = []
            for rank, name in enumerate(names):
                if space.check([f"left/{name}"]):
                    record = json.loads(space.get(f"left/{name}"))
                    gone.append({"name": name, "rank": rank, **record})
            return gone
    except Exception:  # the world just ended: nothing to add
        return []


def _workers(
    address: str, answers: dict[int, tuple[str, dict[str, Any] | None, float | None]],
    timeout: float, blank: dict[str, Any] | None,
) -> list[dict[str, Any]]:  # fmt: skip
    known = {e["rank"]: e for e in _registry.worlds().get(address, [])}
    workers = []
    for rank, (name, answer, joined) in answers.items():
        if answer is None:
            here = known.get(rank, {})
            answer = {"name": name, "rank": rank, "attempt": here.get("attempt", 0),
                      "pid": here.get("pid"), "host": here.get("host"), **(blank or {}),
                      "error": _silent_worker(here.get("pid"), timeout)}  # fmt: skip
        if joined is not None:
            answer = {**answer, "joined_at": joined}
        workers.append(answer)
    return workers


def joined_note(worker: dict[str, Any]) -> str:
    """ ", joined 14:02:07" for a worker added while the world ran; "" for the others."""
    joined = worker.get("joined_at")
    return f", joined {time.strftime('%H:%M:%S', time.localtime(joined))}" if joined else ""


def attempt_note(worker: dict[str, Any]) -> str:
    """ ", attempt N" for a worker replaced N times (a world that heals); "" for the first."""
    attempt = worker.get("attempt") or 0
    return f", attempt {attempt}" if attempt > 0 else ""


def _silent_worker(pid: int | None, timeout: float) -> str:
    if is_stopped(pid):
        return (
            f"no answer within {timeout:.1f} s: it is stopped (SIGSTOP/Ctrl-Z); resume it "
            f"with kill -CONT {pid}, or fg in its terminal"
        )
    return f"no answer within {timeout:.1f} s ({_NO_ANSWER})"


# Why a worker may not answer: its watcher thread cannot run, or it has none yet.
_NO_ANSWER = (
    "a thread of it holds the GIL, it is stopped or gone, or, in a world torch started, "
    "asyncrpc has not run in it yet"
)


_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket


def store_holder(address: str) -> int | None:
    """The pid of the process on this machine listening on `address`'s port, None if unknown."""
    port = address.rpartition(":")[2]
    if not port.isdigit():
        return None
    inodes = _listening_inodes(int(port))
    if not inodes:
        return None
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None


def is_stopped(pid: int | None) -> bool:
    """True when process `pid` is stopped (SIGSTOP, Ctrl-Z) or held by a tracer."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _silent_store(address: str, entries: list[dict[str, Any]], waited: float) -> str:
    """Why the store at `address` gave no answer within `waited` s, naming its process."""
    pid = store_holder(address)
    if pid is None:
        return (
            f"the store at {address} does not answer within {waited:.1f} s: the process "
            f"holding it may be stopped (SIGSTOP/Ctrl-Z) or too busy to answer; resume it "
            f"(kill -CONT, or fg in its terminal)"
        )
    held = f"the store at {address} (held by pid {pid}, {_name(pid, entries)})"
    if is_stopped(pid):
        return (
            f"{held} does not answer: it is stopped (SIGSTOP/Ctrl-Z); resume it with "
            f"kill -CONT {pid}, or fg in its terminal"
        )
    return (
        f"{held} does not answer within {waited:.1f} s: it may be stopped (SIGSTOP/Ctrl-Z), "
        f"or too busy to answer"
    )


def _name(pid: int, entries: list[dict[str, Any]]) -> str:
    """The worker's name for a worker of the world, else the process's command line."""
    for entry in entries:
        if entry.get("pid") == pid:
            return str(entry["name"])
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return "an unknown process"
    shown = " ".join(os.path.basename(w) if i < 2 else w for i, w in enumerate(words[:3]) if w)
    return shown or "an unknown process"


def _listening_inodes(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)
                for row in rows:
                    cols = row.split()
                    local = cols[1].rsplit(":", 1)
                    if len(cols) > 9 and cols[3] == _LISTEN and int(local[1], 16) == port:
                        found.add(f"socket:[{cols[9]}]")
        except (OSError, ValueError, IndexError):
            continue
    return found


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _running_for() -> float:
    """Seconds since this process started (its imports included); 0 where unknown."""
    started = _registry.process_started(os.getpid())
    try:
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return 0.0 if started is None else max(0.0, now - started / os.sysconf("SC_CLK_TCK"))


def _listing(worlds: dict[str, list[dict[str, Any]]]) -> str:
    if not worlds:
        return "none is running"
    rows = [
        f"  {address}  {len(entries[0]['names'])} workers ({', '.join(entries[0]['names'][:4])}"
        f"{', ...' if len(entries[0]['names']) > 4 else ''})"
        for address, entries in sorted(worlds.items())
    ]
    return "the worlds running:\n" + "\n".join(rows)


def run_command(command: Callable[[list[str] | None], None], argv: list[str] | None) -> NoReturn:
    """Run an inspecting command, then end the process at once (`os._exit`), output flushed.

    A thread of ours may still be inside torch's store client (a store that
    went away while it was asked): the interpreter's teardown then meets
    torch's C++ objects half-used, and the process aborts (SIGABRT,
    "terminate called without an active exception") after a complete answer.
    """
    code = 0
    try:
        command(argv)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)


def _fail(code: int, message: str) -> NoReturn:
    print(f"{sys.argv[0].rsplit('/', 1)[-1]}: {message}", file=sys.stderr)
    raise SystemExit(code)
