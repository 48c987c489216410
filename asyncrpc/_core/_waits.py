"""Who waits on whom across a world, from every worker's dump; the cycles in it, named.

A call waits on the calls it made (each worker's calls in flight carry the
key of the call they were made from). A call that has not started on its
callee waits for a free RPC thread there, so, when every RPC thread of that
worker is busy, it waits on every call holding one. A reply, too, is
delivered by one of the caller's RPC threads (torch completes a call's
Future on its pool): a call its callee no longer runs, pending for a second
or more while every RPC thread of the caller is busy, waits on those::

    worker0 f (thread 1) ──made──> worker1 g ──made──> worker0 h: not running, and
         ^                                              worker0's 2 threads are busy
         └──────────────── holds one of them ───────────┘          => cycle

`cycles(reports)` returns each cycle once, as the list of (worker, call)
steps in order (cycles made of calls of the same functions on the same
workers count once); `describe(cycle)` writes it as one line with the word
"cycle".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Step", "cycles", "describe"]

Step = tuple[str, str]  # (worker, what it runs, or "(queued)")
_Node = tuple[str, int]  # (worker, call key); -1: calls queued there, -2: replies queued
_REPLY_AGE_S = 1.0  # younger, a call the callee no longer runs may still be on the wire


def cycles(reports: Sequence[dict[str, Any]]) -> list[list[Step]]:
    """Every cycle of waits in these dumps, each once, from its earliest-sorting step."""
    edges, labels = _graph(reports)
    found: list[list[_Node]] = []
    seen: set[tuple[_Node, ...]] = set()
    for start in sorted(edges):
        for cycle in _cycles_from(start, edges):
            shape = _canonical(cycle)
            if shape not in seen:
                seen.add(shape)
                found.append(list(shape))
    named: list[list[Step]] = []
    for cycle in found:  # two calls of f() waiting alike make one cycle as the user sees it
        steps = [(worker, labels[(worker, key)]) for worker, key in cycle]
        if steps not in named:
            named.append(steps)
    return named


def describe(cycle: list[Step]) -> str:
    """`cycle: worker0 f() -> worker1 g() -> worker0 (queued) -> back to worker0 f()`."""
    steps = " -> ".join(f"{worker} {what}" for worker, what in cycle)
    worker, what = cycle[0]
    return f"cycle: {steps} -> back to {worker} {what}"


def _graph(
    reports: Sequence[dict[str, Any]],
) -> tuple[dict[_Node, set[_Node]], dict[_Node, str]]:
    by_name = {r["name"]: r for r in reports}
    edges: dict[_Node, set[_Node]] = {}
    labels: dict[_Node, str] = {}
    for report in reports:
        name = report["name"]
        for call in report["threads"]:
            labels[(name, call["key"])] = call["call"]
        busy = [c["key"] for c in report["threads"] if c.get("thread") is not None]
        if busy and len(busy) >= report["total_threads"]:  # nothing new can start here
            labels[(name, -1)] = f"(queued: all {report['total_threads']} RPC threads busy)"
            edges[(name, -1)] = {(name, key) for key in busy}
    for report in reports:
        name = report["name"]
        running = {c["key"] for c in report["threads"]}
        for call in report["in_flight"]:
            callee = by_name.get(call["to"])
            if call["parent"] not in running or callee is None:
                continue  # made outside any call (a main thread): nothing waits on it
            target = _where(callee, call["key"])
            if target is None and call.get("age_s", 0) >= _REPLY_AGE_S:
                target = _reply_queue(report, edges, labels)
            if target is not None:
                edges.setdefault((name, call["parent"]), set()).add(target)
    return edges, labels


def _reply_queue(
    caller: dict[str, Any], edges: dict[_Node, set[_Node]], labels: dict[_Node, str]
) -> _Node | None:
    """Where a reply waits when every RPC thread of its caller is busy, else None."""
    busy = [c["key"] for c in caller["threads"] if c.get("thread") is not None]
    if not busy or len(busy) < caller["total_threads"]:
        return None
    node = (caller["name"], -2)
    labels[node] = f"(reply waits: all {caller['total_threads']} RPC threads busy)"
    edges[node] = {(caller["name"], key) for key in busy}
    return node


def _where(callee: dict[str, Any], key: int) -> _Node | None:
    """The node a call to `callee` waits at: its running call, or the worker's queue."""
    if any(c["key"] == key for c in callee["threads"]):
        return (callee["name"], key)
    busy = [c for c in callee["threads"] if c.get("thread") is not None]
    if busy and len(busy) >= callee["total_threads"]:
        return (callee["name"], -1)
    return None  # on its way, or about to start: no wait yet


def _cycles_from(start: _Node, edges: dict[_Node, set[_Node]]) -> list[list[_Node]]:
    found = []
    stack: list[tuple[_Node, list[_Node]]] = [(start, [start])]
    while stack:
        node, path = stack.pop()
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                found.append(path)
            elif nxt not in path and nxt > start:  # each cycle from its smallest node
                stack.append((nxt, [*path, nxt]))
    return found


def _canonical(cycle: list[_Node]) -> tuple[_Node, ...]:
    # From its smallest call (a queue is never first: it is where a call waits).
    calls = [node for node in cycle if node[1] >= 0] or cycle
    first = cycle.index(min(calls))
    return tuple(cycle[first:] + cycle[:first])
