"""`asyncrpc-top`: a live view of a running world, one row per worker, about once a second.

    asyncrpc-top [--world HOST:PORT] [--once] [--json] [--interval S]

Each row: name, host, pid, resident MB, CPU %, busy/total RPC threads,
calls running, calls in flight, open streams, failures so far, and the p50
and p99 latency of the calls that ended in the last interval. The live view
draws with `rich` (`pip install 'asyncrpc[top]'`); without it, a table is
printed each interval. `--once` prints one snapshot (`--json`: as
``{"world", "workers": [{"name", "host", "pid", "rss_mb", "cpu_percent",
"busy_threads", "total_threads", "running", "in_flight", "streams",
"failures", "p50_ms", "p99_ms"}]}``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ._worlds import ask_world, pick_world

__all__ = ["COLUMNS", "main", "rows"]

COLUMNS = (
    ("worker", "name"), ("host", "host"), ("pid", "pid"), ("RSS MB", "rss_mb"),
    ("CPU %", "cpu_percent"), ("busy/threads", "threads"), ("running", "running"),
    ("in flight", "in_flight"), ("streams", "streams"), ("failures", "failures"),
    ("p50 ms", "p50_ms"), ("p99 ms", "p99_ms"),
)  # fmt: skip


def rows(workers: list[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one row per worker, as the command shows them."""
    out = []
    for worker in workers:
        if "error" in worker:
            out.append([worker["name"], "-", "-", worker["error"]] + [""] * (len(COLUMNS) - 4))
            continue
        cells = []
        for _, key in COLUMNS:
            if key == "threads":
                cells.append(f"{worker['busy_threads']}/{worker['total_threads']}")
            else:
                value = worker.get(key)
                cells.append("-" if value is None else str(value))
        out.append(cells)
    return out


def _plain(address: str, workers: list[dict[str, Any]]) -> str:
    table = [[title for title, _ in COLUMNS], *rows(workers)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = [f"world {address}, {time.strftime('%H:%M:%S')}"]
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in table
    ]
    return "\n".join(lines)


def _rich_table(address: str, workers: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=f"asyncrpc world {address}  {time.strftime('%H:%M:%S')}")
    for title, key in COLUMNS:
        table.add_column(title, justify="left" if key in ("name", "host") else "right")
    for cells in rows(workers):
        table.add_row(*cells)
    return table


def _live(address: str, entry: dict[str, Any], interval: float) -> None:
    try:
        from rich.live import Live
    except ImportError:
        print("(rich is not installed: pip install 'asyncrpc[top]' for the live view)")
        while True:
            print(_plain(address, ask_world(address, entry, "top")), flush=True)
            time.sleep(interval)
    with Live(_rich_table(address, ask_world(address, entry, "top")), auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            live.update(_rich_table(address, ask_world(address, entry, "top")), refresh=True)


def main(argv: list[str] | None = None) -> None:
    """The `asyncrpc-top` command."""
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
    address, entry = pick_world(opts.world)
    if not opts.once:
        try:
            _live(address, entry, opts.interval)
        except KeyboardInterrupt:
            return
    workers = ask_world(address, entry, "top")
    if opts.json:
        print(json.dumps({"world": address, "workers": workers}, indent=2))
    else:
        print(_plain(address, workers))


if __name__ == "__main__":
    main()
