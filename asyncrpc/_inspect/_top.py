"""`asyncrpc-top`: a live view of a running world, one row per worker, about once a second.

    asyncrpc-top [--world HOST:PORT] [--once] [--json] [--interval S]

Each row: name (with "(attempt N)" for a worker replaced N times in a
world that heals), host, pid, resident MB, CPU %, busy/total RPC threads,
calls running, calls in flight, open streams, failures so far, the p50
and p99 latency of the calls that ended in the last interval, and the
objects it holds: values `put` there that a ref still holds / values it
fetched, and their MB. The live view
draws with `rich` (`pip install 'asyncrpc[top]'`); without it, a table is
printed each interval. `--once` prints one snapshot (`--json`: as
``{"world", "workers": [{"name", "rank", "attempt", "host", "pid", "rss_mb", "cpu_percent",
"busy_threads", "total_threads", "running", "in_flight", "streams",
"failures", "p50_ms", "p99_ms", "objects": {"kept", "kept_bytes", "fetched",
"fetched_bytes"}}]}``).
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from .._core import _registry
from ._worlds import (
    Unreachable,
    ask_world,
    attempt_note,
    pick_world,
    quiet_stderr,
    run_command,
    try_ask_world,
)

__all__ = ("COLUMNS", "main", "rows")

# The keys of a row; a worker that does not answer has them as None.
_BLANK = dict.fromkeys(
    ("rss_mb", "cpu_percent", "busy_threads", "total_threads", "running", "in_flight",
     "streams", "failures", "p50_ms", "p99_ms", "objects")
)  # fmt: skip

COLUMNS = (
    ("worker", "name"), ("host", "host"), ("pid", "pid"), ("RSS MB", "rss_mb"),
    ("CPU %", "cpu_percent"), ("busy", "threads"), ("run", "running"),
    ("out", "in_flight"), ("strm", "streams"), ("fail", "failures"),
    ("p50 ms", "p50_ms"), ("p99 ms", "p99_ms"), ("objs", "objects"), ("obj MB", "object_mb"),
)  # fmt: skip
# Short titles, so that the table fits an 80-column terminal; the legend says them whole.
LEGEND = (
    "busy: busy/total RPC threads  run: calls running  out: calls in flight to others",
    "strm: open streams  fail: failures so far  p50/p99: latency in the last interval",
    "objs: values put there (a ref holds) / values fetched there  obj MB: their size",
)


def rows(workers: list[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one row per worker, as the command shows them."""
    out = []
    for worker in workers:
        if "error" in worker:  # said below the table (`_notes`)
            pid = "-" if worker.get("pid") is None else str(worker["pid"])
            dashes = ["-"] * (len(COLUMNS) - 3)
            out.append([_name(worker), worker.get("host") or "-", pid, *dashes])
            continue
        cells = []
        for _, key in COLUMNS:
            if key == "name":
                cells.append(_name(worker))
            elif key == "threads":
                cells.append(f"{worker['busy_threads']}/{worker['total_threads']}")
            elif key in ("objects", "object_mb"):
                cells.append(_objects(worker.get("objects"), key))
            else:
                value = worker.get(key)
                cells.append("-" if value is None else str(value))
        out.append(cells)
    return out


def _objects(held: dict[str, int] | None, key: str) -> str:
    if not held:  # a worker of an older asyncrpc, or one that did not answer
        return "-"
    if key == "objects":
        return f"{held['kept']}/{held['fetched']}"
    return f"{(held['kept_bytes'] + held['fetched_bytes']) / 2**20:.1f}"


def _name(worker: dict[str, Any]) -> str:
    """The worker's name, with "(attempt N)" for a worker replaced N times (a world that heals)."""
    note = attempt_note(worker)
    return f"{worker['name']} ({note[2:]})" if note else str(worker["name"])


def _notes(workers: list[dict[str, Any]], more: list[str]) -> list[str]:
    return [*more, *(f"{w['name']}: {w['error']}" for w in workers if "error" in w)]


def _plain(address: str, workers: list[dict[str, Any]], more: Sequence[str] = ()) -> str:
    table = [[title for title, _ in COLUMNS], *rows(workers)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = [f"world {address}, {time.strftime('%H:%M:%S')}"]
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
    return "\n".join([*lines, *_notes(workers, list(more)), *LEGEND])


def _rich_table(address: str, workers: list[dict[str, Any]], more: list[str]) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(
        title=f"asyncrpc world {address}  {time.strftime('%H:%M:%S')}",
        caption="\n".join([*_notes(workers, more), *LEGEND]),
        box=box.SIMPLE_HEAD, padding=0, show_edge=False, caption_justify="left",
    )  # fmt: skip
    for title, key in COLUMNS:
        # Numbers never wrap; a long host name gives way first, then the worker's name.
        table.add_column(
            title, justify="left" if key in ("name", "host") else "right",
            no_wrap=True, overflow="ellipsis", min_width=len(title),
            max_width=12 if key == "host" else None,
        )  # fmt: skip
    for cells in rows(workers):
        table.add_row(*cells)
    return table


def _ask(address: str, entry: dict[str, Any]) -> list[dict[str, Any]]:
    workers = ask_world(address, entry, "top", blank=_BLANK)
    if all("error" in w for w in workers) and _ended(address, _ENDING_S):
        _end(address)
    return workers


def _turn(address: str, entry: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """One turn of the live view: the rows, and a note when the world's store gave none."""
    got = try_ask_world(address, entry, "top", blank=_BLANK)
    if isinstance(got, Unreachable):
        if _ended(address, 0.0 if got.silent else _ENDING_S):
            _end(address)
        return [], [got.reason]
    if all("error" in w for w in got) and _ended(address, _ENDING_S):
        _end(address)
    return got, []


_ENDING_S = 3.0  # how long a world whose store is gone may take to leave the listing


def _ended(address: str, wait: float) -> bool:
    """True once no worker of the world at `address` is registered here, waiting `wait` s."""
    deadline = time.monotonic() + wait
    while address in _registry.worlds():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _end(address: str) -> NoReturn:
    print(f"the world ended ({address})", flush=True)
    raise SystemExit(0)


def _live(address: str, entry: dict[str, Any], interval: float) -> None:
    """Redraw every `interval` s until Ctrl-C, which ends the view at its next turn.

    Ctrl-C only sets a flag: raised inside a call to the store, it would come
    out as the store's error (or stop a write to the terminal half-way).
    """
    stop = _Flag()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        with quiet_stderr():  # torch's C++ log of a store that went away: the view says it
            _draw(address, entry, interval, stop)
    except (Exception, SystemExit):
        if not stop.is_set():
            raise  # not an interrupted turn: a real failure
    finally:
        signal.signal(signal.SIGINT, previous)


class _Flag:
    """Set by the Ctrl-C handler; the view polls it. Not a `threading.Event`: its `set`
    takes the lock that the interrupted `wait` may hold, and the view then hangs."""

    def __init__(self) -> None:
        self.stopped = False

    def set(self) -> None:
        self.stopped = True

    def is_set(self) -> bool:
        return self.stopped

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking early once set; whether it is set."""
        deadline = time.monotonic() + seconds
        while not self.stopped and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, _POLL_S))
        return self.stopped


_POLL_S = 0.05


def _draw(address: str, entry: dict[str, Any], interval: float, stop: _Flag) -> None:
    try:
        from rich.live import Live
    except ImportError:
        print("(rich is not installed: pip install 'asyncrpc[top]' for the live view)")
        while not stop.is_set():
            print(_plain(address, *_turn(address, entry)), flush=True)
            stop.wait(interval)
        return
    with Live(_rich_table(address, *_turn(address, entry)), auto_refresh=False) as live:
        while not stop.wait(interval):
            live.update(_rich_table(address, *_turn(address, entry)), refresh=True)


def main(argv: list[str] | None = None) -> None:
    """The `asyncrpc-top` command (it ends the process: `run_command`)."""
    run_command(_main, argv)


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(
        prog="asyncrpc-top", description="A live view of a running asyncrpc world."
    )
    parser.add_argument("--world", help="the world's rendezvous address, host:port")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print JSON")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between views")
    opts = parser.parse_args(argv)
    if opts.json and not opts.once:
        parser.error("--json needs --once")
    if not opts.interval > 0:  # also NaN
        parser.error(f"--interval must be a number of seconds above 0, got {opts.interval}")
    address, entry = pick_world(opts.world)
    if not opts.once:
        _live(address, entry, opts.interval)
        return
    workers = _ask(address, entry)
    if opts.json:
        print(json.dumps({"world": address, "workers": workers}, indent=2))
    else:
        print(_plain(address, workers))


if __name__ == "__main__":
    main()
