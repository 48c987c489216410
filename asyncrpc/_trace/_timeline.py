"""One timeline from many workers: merging their traces, and drawing the result.

Each worker's part is torch's Chrome trace (times relative to its
`baseTimeNanoseconds`) plus asyncrpc's call spans (Unix nanoseconds). The
merge puts everything on the caller's clock, in microseconds from the first
event::

    worker part: profiler events (pid = OS pid) + call spans ("call", "run", id)
                 + marks of joins and leaves ("member": an instant on the worker)
                 + its CUDA kernels and copies (the profiler's GPU pseudo-processes)
      `-> process per worker (pid = rank + 1, named by worker and, for a replacement
          in a world that heals, its attempt), its threads named,
          call spans on lanes of their own ("calls out", "calls in"),
          CUDA work on a lane per device and stream ("cuda:0 stream 7"),
          flow "s" at a call's start -> flow "f" at its run on the callee
"""

from __future__ import annotations

import json
import os
import pathlib
import types
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ("merge", "write")

CATEGORY = "asyncrpc"
_LANE_TID = types.MappingProxyType(
    {"call": 1_000_000_000, "run": 1_100_000_000, "member": 1_200_000_000, "cuda": 1_300_000_000}
)
_LANE_NAME = types.MappingProxyType(
    {"call": "calls out", "run": "calls in", "member": "members", "cuda": "cuda"}
)
_KEPT_PHASES = frozenset({"X", "i", "I"})
# The profiler's CUDA work (ProfilerActivity.CUDA): on a pseudo-process per GPU in
# torch's trace, put on the worker that ran it, a lane per device and stream.
_CUDA_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_STREAMS = 10_000  # a cuda lane's tid: base + device * _STREAMS + stream


def merge(
    names: Sequence[str], parts: Mapping[str, Mapping[str, Any]], offsets: Mapping[str, int]
) -> list[dict[str, Any]]:
    """Every worker's events on one clock, as Chrome trace events (see the module doc)."""
    events: list[dict[str, Any]] = []
    runs: dict[int, dict[str, Any]] = {}
    calls: list[dict[str, Any]] = []
    for rank, name in enumerate(names):
        pid, part = rank + 1, parts[name]
        shift_us = -offsets.get(name, 0) / 1000
        worker_events = _profiler_events(part, pid, shift_us)
        spans = _lane_spans(part["spans"], pid, shift_us)
        for span in spans:
            ident = span["args"].get("call")
            if ident and span["args"]["kind"] == "run":
                runs[ident] = span
            elif ident:
                calls.append(span)
        tids = {e["tid"] for e in worker_events} | {s["tid"] for s in spans}
        label = str(part.get("label") or name)  # a replacement's: "worker3 (attempt 1)"
        events += _process_metadata(pid, rank, label, tids, part["threads"])
        events += worker_events + spans
    events += _flows(calls, runs)
    timed = [e for e in events if "ts" in e and e["ph"] != "M"]
    origin = min((e["ts"] for e in timed), default=0.0)
    for event in timed:
        event["ts"] = round(event["ts"] - origin, 3)
    return events


def _profiler_events(part: Mapping[str, Any], pid: int, shift_us: float) -> list[dict[str, Any]]:
    trace = json.loads(part["trace"]) if part["trace"] else {}
    base_us = trace.get("baseTimeNanoseconds", 0) / 1000
    kept = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") not in _KEPT_PHASES:
            continue
        if event.get("cat") in _CUDA_CATEGORIES:
            args = event.get("args", {})
            lane = int(args.get("device", 0)) * _STREAMS + int(args.get("stream", 0)) % _STREAMS
            event = {**event, "tid": _LANE_TID["cuda"] + lane}
        elif event.get("pid") != part["pid"]:
            continue  # the profiler's own pseudo-processes; metadata is rewritten
        kept.append({**event, "pid": pid, "ts": base_us + float(event["ts"]) + shift_us})
    return kept


def _lane_spans(
    spans: Sequence[Mapping[str, Any]], pid: int, shift_us: float
) -> list[dict[str, Any]]:
    # A call's span outlives the thread's other work (rpc_async returns at once),
    # so spans go on lanes of their own, where none overlaps another.
    lane_ends: dict[str, list[float]] = {"call": [], "run": []}
    placed = []
    for span in sorted(spans, key=lambda s: (s["start"], s["end"])):
        kind, start, end = span["kind"], span["start"] / 1000, span["end"] / 1000
        if kind == "member":  # a join or leave: a mark across the worker's timeline
            placed.append({"ph": "i", "s": "p", "cat": CATEGORY, "name": span["name"],
                           "pid": pid, "tid": _LANE_TID[kind], "ts": start + shift_us,
                           "args": {"kind": kind}})  # fmt: skip
            continue
        ends = lane_ends[kind]
        lane = next((i for i, e in enumerate(ends) if e <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        args = {"kind": kind, "call": span["id"], "thread": span["tid"]}
        for key in ("to", "outcome"):
            if key in span:
                args[key] = span[key]
        placed.append(
            {
                "ph": "X",
                "cat": CATEGORY,
                "name": span["name"],
                "pid": pid,
                "tid": _LANE_TID[kind] + lane,
                "ts": start + shift_us,
                "dur": round(end - start, 3),
                "args": args,
            }
        )
    return placed


def _flows(calls: list[dict[str, Any]], runs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    flows = []
    for call in calls:
        run = runs.get(call["args"]["call"])
        if run is None:
            continue
        ident = call["args"]["call"]
        common = {"cat": CATEGORY, "name": "rpc", "id": ident}
        for side, phase in ((call, {"ph": "s"}), (run, {"ph": "f", "bp": "e"})):
            where = {key: side[key] for key in ("pid", "tid", "ts")}
            flows.append({**common, **phase, **where})
    return flows


def _process_metadata(
    pid: int, rank: int, name: str, tids: set[int], threads: Mapping[Any, str]
) -> list[dict[str, Any]]:
    meta = [_meta("process_name", pid, 0, name=name), _meta("process_sort_index", pid, 0, rank)]
    known = {int(tid): label for tid, label in threads.items()}
    for tid in sorted(tids):
        label, order = _thread_label(tid, known.get(tid))
        meta.append(_meta("thread_name", pid, tid, name=label))
        meta.append(_meta("thread_sort_index", pid, tid, order))
    return meta


def _meta(kind: str, pid: int, tid: int, order: int = 0, name: str = "") -> dict[str, Any]:
    args: dict[str, Any] = {"name": name} if name else {"sort_index": order}
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def _thread_label(tid: int, python_name: str | None) -> tuple[str, int]:
    for kind, base in _LANE_TID.items():
        if base <= tid < base + 100_000_000:
            lane = tid - base
            if kind == "cuda":
                device, stream = divmod(lane, _STREAMS)
                return f"cuda:{device} stream {stream}", 1_000_000 + lane
            return f"{_LANE_NAME[kind]}" + (f" {lane + 1}" if lane else ""), 2_000_000 + tid - base
    if python_name == "MainThread":
        return "main thread", 0
    if python_name is not None and python_name.startswith("Dummy-"):
        # A thread torch started that ran Python: in a worker, an RPC thread.
        return f"rpc thread {tid}", 1 + tid % 1_000_000
    if python_name is None:
        return f"thread {tid}", 1 + tid % 1_000_000
    return python_name, 1 + tid % 1_000_000


def write(
    path: pathlib.Path,
    events: list[dict[str, Any]],
    names: Sequence[str],
    offsets: Mapping[str, int],
) -> None:
    """Write merged events as a Chrome trace file (JSON object format)."""
    document = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "asyncrpc": {
                "workers": list(names),
                "clock_offsets_us": {n: offsets.get(n, 0) / 1000 for n in names},
            }
        },
    }
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document))
    os.replace(partial, path)
