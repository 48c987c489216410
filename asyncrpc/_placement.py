"""Where `spawn(to=None)` or `spawn(to=role)` puts an object: the least-loaded worker.

The caller asks every candidate (all members, or those of the role) for its
load, and picks the least by one rule: fewest objects held (those `spawn`
built there and still alive), then fewest calls running now, then a worker
other than the caller, then the lowest rank::

    caller                         each candidate
    place(None) ── _load() ──────> (objects held, calls running)
      min by (held, running, is the caller, rank) ──> spawn(that worker, cls, ...)

Two callers placing at once may pick the same worker: each sees the loads
as they were when it asked.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ._core import _calls, _cancel, _runtime
from ._core._elastic import members
from ._core._futures import gather
from ._core._world import current_context

__all__ = ("count_held", "place")


class Held:
    """How many objects `spawn` built on this worker are alive (a `_runtime` part)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def add(self, obj: object) -> None:
        with self.lock:
            self.count += 1
        try:
            weakref.finalize(obj, self._release)
        except TypeError:
            pass  # an object that cannot be weakly referenced counts until the world ends

    def _release(self) -> None:
        with self.lock:
            self.count -= 1


def count_held(obj: object) -> None:
    """Count `obj`, which `spawn` just built here, until it is released."""
    _runtime.part(Held).add(obj)


def _load() -> tuple[int, int]:
    return _runtime.part(Held).count, _cancel.bookkeeping()["running"]


def place(to: Any) -> Any:
    """`to` itself when it names a worker; else the least-loaded of its candidates."""
    if isinstance(to, str) and to in members():
        return to
    if to is not None and not isinstance(to, str):
        return to  # a rank or a WorkerInfo: `spawn` checks it
    candidates = _candidates(to)
    if not candidates:
        return to  # neither a worker nor a role: `spawn` says so, with the names it has
    loads = gather([_calls.rpc_async(name, _load) for name in candidates]).wait()
    me = current_context().name
    ranked = sorted(
        (held, running, name == me, rank, name)
        for rank, (name, (held, running)) in enumerate(zip(candidates, loads, strict=True))
    )
    return ranked[0][-1]


def _candidates(role: str | None) -> list[str]:
    live = list(members())
    if role is None:
        return live
    return [n for n in live if n.startswith(role) and n[len(role) :].isdigit()]
