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

A cycle is certain (it never ends by itself) only when every wait in it can
end only by the end of a wait that is itself certain never to end. A call
waits until each call it made has ended, so one of them that never ends is
enough; a queue for RPC threads empties once any one of the busy threads is
free, so it never does only when every call holding one never ends. `stuck`
finds the calls that never end as torch's pool would: it lets end, again and
again, each call that waits on nothing, and each queue with a thread free,
until none is left to end; what remains is stuck. A cycle through a queue on
threads one of which is held by a call that can still end (`slow()` sleeping
there) is a wait, not a cycle: it ends with that call::

    worker0 f ──> worker1 g ──> worker0 (queued) ──> {worker0 f, worker0 slow()}
                                                       slow() waits on nothing: it
                                                       ends, h() starts => "waiting"

`cycles(reports)` returns each certain cycle once, as the list of (worker,
call) steps in order (cycles made of calls of the same functions on the same
workers count once); `describe(cycle)` writes it as one line with the word
"cycle". `waits(reports)` returns the other cycles of the graph, each with
the calls whose end ends it, and `describe_wait` writes one as a "waiting:"
line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Step", "cycles", "describe", "describe_wait", "stuck", "waits"]

Step = tuple[str, str]  # (worker, what it runs, or "(queued)")
_Node = tuple[str, int]  # (worker, call key); -1: calls queued there, -2: replies queued
_REPLY_AGE_S = 1.0  # younger, a call the callee no longer runs may still be on the wire


def cycles(reports: Sequence[dict[str, Any]]) -> list[list[Step]]:
    """Every certain cycle of waits in these dumps, each once, from its earliest-sorting step."""
    edges, labels = _graph(reports)
    stalled = _stalled(edges)
    inside = {node: {n for n in nxt if n in stalled} for node, nxt in edges.items()}
    return _named(_all_cycles({n: e for n, e in inside.items() if n in stalled}), labels)


def waits(reports: Sequence[dict[str, Any]]) -> list[tuple[list[Step], list[Step]]]:
    """Every cycle of waits that can still end: (its steps, the calls whose end frees it)."""
    edges, labels = _graph(reports)
    stalled = _stalled(edges)
    certain = cycles(reports)
    found: list[tuple[list[Step], list[Step]]] = []
    for cycle in _all_cycles(edges):
        if all(node in stalled for node in cycle):
            continue
        steps = [(worker, labels[(worker, key)]) for worker, key in cycle]
        frees = sorted(
            {(n[0], labels.get(n, "?")) for q in cycle if q[1] < 0 for n in edges[q]
             if n not in stalled and n not in cycle}
        )  # fmt: skip
        if steps not in certain and all(steps != seen for seen, _ in found):
            found.append((steps, frees))
    return found


def stuck(reports: Sequence[dict[str, Any]]) -> set[tuple[str, int]]:
    """(worker, key) of each call running that never ends (it waits on a cycle that never does)."""
    stalled = _stalled(_graph(reports)[0])
    return {node for node in stalled if node[1] >= 0}


def describe(cycle: list[Step]) -> str:
    """`cycle: worker0 f() -> worker1 g() -> worker0 (queued) -> back to worker0 f()`."""
    steps = " -> ".join(f"{worker} {what}" for worker, what in cycle)
    worker, what = cycle[0]
    return f"cycle: {steps} -> back to {worker} {what}"


def describe_wait(wait: tuple[list[Step], list[Step]]) -> str:
    """`waiting: worker0 f() -> ... -> back to worker0 f(); it ends when worker0 slow() ends`."""
    steps, frees = wait
    line = "waiting:" + describe(steps).removeprefix("cycle:")
    if not frees:
        return line
    ending = " or ".join(f"{worker} {what}" for worker, what in frees)
    return f"{line} (not a deadlock: it ends when {ending} ends)"


def _stalled(edges: dict[_Node, set[_Node]]) -> set[_Node]:
    """The nodes that never end, by letting end whatever can, as the workers would.

    A call ends once it waits on nothing left (each call it made has ended); a
    queue (id < 0) moves once any thread it waits for is free. What cannot end
    this way waits only on what cannot end: for ever.
    """
    nodes = set(edges) | {n for nxt in edges.values() for n in nxt}
    left = set(nodes)
    changed = True
    while changed:
        changed = False
        for node in sorted(left):
            nxt = edges.get(node, set())
            blocked = bool(nxt) and nxt <= left if node[1] < 0 else bool(nxt & left)
            if not blocked:
                left.discard(node)
                changed = True
    return left


def _all_cycles(edges: dict[_Node, set[_Node]]) -> list[list[_Node]]:
    found: list[list[_Node]] = []
    seen: set[tuple[_Node, ...]] = set()
    for start in sorted(edges):
        for cycle in _cycles_from(start, edges):
            shape = _canonical(cycle)
            if shape not in seen:
                seen.add(shape)
                found.append(list(shape))
    return found


def _named(found: list[list[_Node]], labels: dict[_Node, str]) -> list[list[Step]]:
    named: list[list[Step]] = []
    for cycle in found:  # two calls of f() waiting alike make one cycle as the user sees it
        steps = [(worker, labels[(worker, key)]) for worker, key in cycle]
        if steps not in named:
            named.append(steps)
    return named


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
