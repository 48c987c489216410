"""Which running world a command looks at, and asking all its workers at once.

asyncrpc-dump [--world host:port]
  registrations (_core._registry) ── one world? ── yes ─> connect to its store
                                      │ none: exit 1, "no world is running"
                                      └ several, no --world: exit 2, listing them
  ask every rank through the side channel (_core._side) ─> answers, in rank order
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from .._core import _registry, _side

__all__ = ["ask_world", "pick_world"]

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
            f"{_registry.folder()}); start one, or run this on a machine where one runs",
        )
    if len(worlds) > 1:
        _fail(EXIT_WHICH_WORLD, f"{len(worlds)} worlds are running: pick one with --world. "
              + _listing(worlds))  # fmt: skip
    address = next(iter(worlds))
    return address, worlds[address][0]


ANSWER_BY_S = 4.0  # from the command's start: it answers within 5 s, its start-up included


def ask_world(
    address: str, entry: dict[str, Any], kind: str, blank: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every worker's answer to `kind`, in rank order.

    A worker that gives none within the command's time (`ANSWER_BY_S`) is
    `{name, rank, pid, host, "error"}` plus `blank`, the keys an answer
    would have; its pid and host are known when it registered on this machine.
    """
    names = list(entry["names"])
    try:
        store = _side.connect(address, entry["prefix"], timeout=2.0)
    except Exception as exc:  # torch's message goes on with C++ frames: its first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _fail(EXIT_NO_WORLD, f"cannot reach the world's store at {address} ({first}); it "
              f"may have just ended")  # fmt: skip
    timeout = max(1.0, ANSWER_BY_S - _running_for())
    answers = _side.ask(store, range(len(names)), kind, timeout)
    known = {e["rank"]: e for e in _registry.worlds().get(address, [])}
    workers = []
    for rank, name in enumerate(names):
        answer = answers[rank]
        if answer is None:
            here = known.get(rank, {})
            answer = {"name": name, "rank": rank, "pid": here.get("pid"),
                      "host": here.get("host"), **(blank or {}),
                      "error": f"no answer within {timeout:.1f} s ({_NO_ANSWER})"}  # fmt: skip
        workers.append(answer)
    return workers


# Why a worker may not answer: its watcher thread cannot run, or it has none yet.
_NO_ANSWER = (
    "a thread of it holds the GIL, it is stopped or gone, or, in a world torch started, "
    "asyncrpc has not run in it yet"
)


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


def _fail(code: int, message: str) -> NoReturn:
    print(f"{sys.argv[0].rsplit('/', 1)[-1]}: {message}", file=sys.stderr)
    raise SystemExit(code)
