"""Which running world a command looks at, and asking all its workers at once.

asyncrpc-dump [--world host:port]
  registrations (_core._registry) ── one world? ── yes ─> connect to its store
                                      │ none: exit 1, "no world is running"
                                      └ several, no --world: exit 2, listing them
  ask every rank through the side channel (_core._side) ─> answers, in rank order
"""

from __future__ import annotations

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


def ask_world(
    address: str, entry: dict[str, Any], kind: str, timeout: float = 4.0
) -> list[dict[str, Any]]:
    """Every worker's answer to `kind`, in rank order (one without an answer says so)."""
    names = list(entry["names"])
    try:
        store = _side.connect(address, entry["prefix"])
    except Exception as exc:
        _fail(EXIT_NO_WORLD, f"cannot reach the world's store at {address} ({exc}); it may "
              f"have just ended")  # fmt: skip
    answers = _side.ask(store, range(len(names)), kind, timeout)
    workers = []
    for rank, name in enumerate(names):
        answer = answers[rank]
        if answer is None:
            answer = {"name": name, "rank": rank, "pid": None,
                      "error": f"no answer within {timeout:g} s"}  # fmt: skip
        workers.append(answer)
    return workers


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
