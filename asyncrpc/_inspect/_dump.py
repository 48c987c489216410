"""`asyncrpc-dump`: every worker's calls, their stacks, what each waits on, and the cycles.

    asyncrpc-dump [--world HOST:PORT] [--json]

Works while every RPC thread of every worker is blocked: each worker's
watcher thread answers through the world's store (see `_core._side`).
Text, per worker: name, rank, pid (and "attempt N" for a worker replaced
N times in a world that heals, "joined HH:MM:SS" for one added while the
world ran); each call it runs (function, calling worker,
age) with its Python stack; the calls it has in flight; then one `cycle:`
line per cycle of waits that never ends by itself, and one `waiting:` line
per cycle that ends when a busy RPC thread in it is free (see `_core._waits`),
and a `left:` line per worker removed from an elastic world (when, by whom).
`--json` prints the same as ``{"world", "left": [{"name", "rank", "at", "why"}],
"workers": [{"name", "attempt", "joined_at" (added ones), "pid",
"threads": [{"call", "caller", "age_s", "stack"}], "in_flight": [{"to",
"call", "age_s"}]}], "cycles": [[worker names in order]], "waits": [{"workers":
[worker names in order], "ends_with": ["worker call()"]}]}``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .._core import _waits
from ._worlds import ask_world, attempt_note, departures, joined_note, pick_world, run_command

__all__ = ("dump", "main")


def dump(address: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The world's dump: every worker's answer, and the cycles of waits among them."""
    workers = ask_world(address, entry, "dump", blank={"threads": [], "in_flight": []})
    answered = [w for w in workers if "error" not in w]
    cycles = _waits.cycles(answered)
    waits = _waits.waits(answered)
    return {
        "world": address,
        "workers": workers,
        "left": departures(address, entry),
        "cycles": [[worker for worker, _ in cycle] for cycle in cycles],
        "waits": [
            {"workers": [w for w, _ in steps], "ends_with": [f"{w} {c}" for w, c in frees]}
            for steps, frees in waits
        ],
        "cycle_lines": [_waits.describe(cycle) for cycle in cycles]
        + [_waits.describe_wait(wait) for wait in waits],
    }


def render(result: dict[str, Any]) -> str:
    """The dump as text, as the command prints it."""
    lines = [f"world {result['world']}: {len(result['workers'])} workers"]
    for worker in result["workers"]:
        lines += _render_worker(worker)
    for gone in result.get("left", []):
        at = time.strftime("%H:%M:%S", time.localtime(gone["at"]))
        lines.append(f"left: {gone['name']} (rank {gone['rank']}) at {at}, {gone['why']}")
    lines += result["cycle_lines"] or ["no cycle of waits"]
    return "\n".join(lines)


def _render_worker(worker: dict[str, Any]) -> list[str]:
    who = f"{worker['name']} (rank {worker['rank']}{attempt_note(worker)}{joined_note(worker)}"
    if "error" in worker:
        pid = "" if worker.get("pid") is None else f", pid {worker['pid']}"
        return [f"{who}{pid}): {worker['error']}"]
    busy = sum(1 for call in worker["threads"] if call.get("thread") is not None)
    lines = [
        f"{who}, pid {worker['pid']}, {worker['host']}): "
        f"{busy} of {worker['total_threads']} RPC threads busy, "
        f"{len(worker['threads'])} calls running, {len(worker['in_flight'])} in flight"
    ]
    for call in worker["threads"]:
        where = f"thread {call['thread']}" if call.get("thread") else "waiting at an await"
        lines.append(
            f"  runs {call['call']} for {call['caller']}, {call['age_s']:.1f} s ({where})"
        )
        lines += [f"    {frame}" for frame in call["stack"]]
    for call in worker["in_flight"]:
        lines.append(f"  waits on {call['to']}: {call['call']}, {call['age_s']:.1f} s")
    return lines


def main(argv: list[str] | None = None) -> None:
    """The `asyncrpc-dump` command (it ends the process: `run_command`)."""
    run_command(_main, argv)


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(
        prog="asyncrpc-dump",
        description="Print every worker's calls, stacks and waits; name cycles of waits.",
    )
    parser.add_argument("--world", help="the world's rendezvous address, host:port")
    parser.add_argument("--json", action="store_true", help="print JSON")
    opts = parser.parse_args(argv)
    address, entry = pick_world(opts.world)
    result = dump(address, entry)
    if opts.json:
        result.pop("cycle_lines")
        print(json.dumps(result, indent=2))
    else:
        print(render(result))


if __name__ == "__main__":
    main()
