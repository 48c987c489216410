"""Where a world that heals lets go of its RRefs: the last reference dropped on one thread.

An RRef's last reference, dropped, deletes its fork at the owner
(RRefContext::delUser), which sends that notice while it holds a lock of
torch's. The send can run other writes' completions on the same thread and
free the tensors they carried; from torch 2.15 freeing a tensor lets the GIL
go (THPVariable_clear). A second Python thread that drops an RRef then takes
the GIL and waits for torch's lock, while the first waits for the GIL: both
stop for good. It happens when a peer dies (its writes fail all at once),
so a survivor of a heal could stick::

    thread A: drop RRef ─> delUser ─ holds torch's lock ─> send ─> a write's
              completion frees a tensor ─> lets the GIL go ─> waits for the GIL
    thread B: takes the GIL ─> drop RRef ─> delUser ─> waits for torch's lock

So, in a world that heals, every user RRef asyncrpc makes or receives is
also held here (`hold`), and one thread of the world's own drops the last
reference of each once nothing else refers to it: no two Python threads
are ever in delUser at once. An RRef lives one sweep (`_SWEEP_S`, longer
for many RRefs) after its program dropped it. Held RRefs are let go when
the world ends, after torch's agent stopped (no notice is sent then).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from .. import _runtime

__all__ = ("Releases", "hold")

_SWEEP_S = 0.02  # the pause between sweeps; at least 4 times the last sweep's time
_STOP_S = 5.0  # what the world's end waits for the thread (one sweep's drops)
_MARK = 0  # the key of the object whose count is the sweep's baseline (no id is 0)


class Releases:
    """The user RRefs held for a world that heals, and the thread that lets them go."""

    __slots__ = ("__weakref__", "held", "lock", "stopping", "thread")

    def __init__(self) -> None:
        # Keyed by id; `_MARK` holds an object referred to by nothing else: the
        # number of references a held RRef has when only this dict holds it.
        self.held: dict[int, Any] = {_MARK: object()}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def close(self) -> None:
        """Stop the thread; the RRefs still held are dropped here (after torch's agent)."""
        self.stopping.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_S)
        with self.lock:
            left = list(self.held.values())
            self.held.clear()
        del left


def hold(rref: Any) -> None:
    """Hold user RRef `rref` until nothing else refers to it, then drop it on the world's thread.

    An owner's own RRef (`is_owner()`) sends no notice when dropped: not held.
    """
    if rref.is_owner():
        return
    releases = _runtime.part(Releases)
    with releases.lock:
        if releases.stopping.is_set():
            return
        releases.held[id(rref)] = rref
        if releases.thread is None:
            releases.thread = threading.Thread(
                target=_run, args=(releases,), name="asyncrpc-rref-release", daemon=True
            )
            releases.thread.start()


def _run(releases: Releases) -> None:
    pause = _SWEEP_S
    while not releases.stopping.wait(pause):
        began = time.monotonic()
        _sweep(releases)
        pause = max(_SWEEP_S, 4 * (time.monotonic() - began))


def _sweep(releases: Releases) -> None:
    """Drop, here, every held RRef that nothing outside `releases` refers to."""
    with releases.lock:
        items = list(releases.held.items())
    unused = _unused(items)
    del items
    with releases.lock:
        dropped = [releases.held.pop(key) for key in unused if key in releases.held]
    del dropped  # the last references: torch deletes each fork at its owner, on this thread


def _unused(items: list[tuple[int, Any]]) -> list[int]:
    """The keys whose object has no more references than the mark (this loop's own only)."""
    counts = [(key, sys.getrefcount(value)) for key, value in items]
    base = dict(counts)[_MARK]
    return [key for key, count in counts if key != _MARK and count <= base]
