"""The workers' stderr through their supervisor: torch's warnings of expected departures dropped.

In a world that heals or grows, workers leave and die while the others run
on, and each time torch's TensorPipe agent, in every process that had a
pipe to the one that went, logs a warning per pipe on stderr (`EOF`,
`EPIPE`, `ECONNRESET`, `pipe closed`; dozens a run). Its supervisor reports
every such end in its own words (a `Left`, a heal's line, the error that
fails the world), so those warnings say nothing new. The workers write
their stderr into a pipe that this supervisor reads and copies to its own
stderr, as it comes, except the warnings about a process that ended or is
leaving::

    worker ──fd 2──> pipe ──> `asyncrpc-stderr` (a thread of the supervisor) ──> stderr
                                a TensorPipe warning (`_torch.pipe_warning`): held up to
                                HOLD_S, dropped once either process it names has ended or
                                is leaving (`gone`), else written (between live workers)
                                torch's report of RRefs left at a worker's end
                                (`_torch.rref_leak`): dropped (see below)

torch also reports, as a worker ends, the RRefs it did not delete. A worker
of a world whose members never changed deletes them all first; workers that
leave or fail, and every worker of a world that healed or lost a member,
delete none (an owner may be gone: `_core/_healing.leave`). So here the
report only follows an end asyncrpc reported, and it is dropped.

Only the pipe warnings wait; everything else (a traceback, a crash's last
words) goes on at once, and it is the supervisor that reads the pipe, so what a
worker wrote before it died is never lost with it. `ASYNCRPC_TORCH_WARNINGS=1`
keeps every line: the workers then write to the caller's stderr themselves.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from .._core import _torch

__all__ = ("HOLD_S", "KEEP_VARIABLE", "Quiet", "quieted")

# Set to 1 to see every line torch writes (a network fault between live workers shows
# anyway): the workers then write to the caller's stderr directly, as elsewhere.
KEEP_VARIABLE = "ASYNCRPC_TORCH_WARNINGS"

HOLD_S = 2.0  # how long a warning waits for its supervisor to see the end it is about
_LOOK_S = 0.1  # how often held warnings are looked at again
_IDLE_S = 0.5  # how often the thread wakes with none held (to see the world's end)
_CLOSE_S = 2.0  # how long the world's end waits for the workers' last output
_READ = 65536


class Quiet:
    """The pipe the workers' stderr goes to, and the thread that copies it to `output`.

    `gone(torch name)`: whether that process has ended or is leaving (read
    from the thread; the supervisor's loop keeps what it reads).
    """

    def __init__(self, output: Connection, gone: Callable[[str], bool]) -> None:
        self.output = output.fileno()
        self.gone = gone
        reader, writer = os.pipe()
        self._reader = reader
        self.writer = Connection(writer, readable=False)  # for the workers (`_child`)
        self._held: list[tuple[float, bytes, tuple[str, str]]] = []  # (until, line, names)
        self._leak = False  # the line before was torch's report of RRefs left
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._copy, name="asyncrpc-stderr", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Every worker has ended: copy what they wrote last (bounded), then stop."""
        if not self.writer.closed:
            self.writer.close()
        self._closing.set()
        self._thread.join(_CLOSE_S + 1.0)
        os.close(self._reader)

    def _copy(self) -> None:
        partial = b""
        deadline = None
        poller = select.poll()  # not select(): a large world's supervisor holds many fds
        poller.register(self._reader, select.POLLIN)
        while True:
            if self._closing.is_set() and deadline is None:
                deadline = time.monotonic() + _CLOSE_S  # a process the world left behind
            wait = _LOOK_S if self._held else _IDLE_S
            ready = poller.poll(wait * 1000)
            chunk = os.read(self._reader, _READ) if ready else b""
            if ready and not chunk:  # every writer closed: the workers are gone
                break
            partial = self._lines(partial + chunk)
            self._release(time.monotonic())
            if deadline is not None and time.monotonic() >= deadline:
                break
        # The world is over: every process a held warning names has ended.
        self._held.clear()
        self._write(partial)

    def _lines(self, data: bytes) -> bytes:
        """Write or hold each whole line of `data`; what is left of an unfinished line."""
        *lines, rest = data.split(b"\n")
        for line in lines:
            leak = _leak(line) or (self._leak and not line.strip())  # with its blank line
            self._leak = leak and bool(line.strip())
            if leak:
                continue
            names = _names(line)
            if names is None:
                self._write(line + b"\n")
            else:
                self._held.append((time.monotonic() + HOLD_S, line + b"\n", names))
        if rest.startswith(b"[W") and len(rest) < _READ:
            return rest  # maybe the start of a warning: wait for its end
        self._write(rest)  # a progress bar's line, say: as it comes
        return b""

    def _release(self, now: float) -> None:
        """Drop the held warnings about a process gone; write those past their time."""
        kept = []
        for until, line, (agent, peer) in self._held:
            if self.gone(agent) or self.gone(peer):
                continue
            if now >= until:
                self._write(line)
            else:
                kept.append((until, line, (agent, peer)))
        self._held = kept

    def _write(self, data: bytes) -> None:
        while data:
            try:
                written = os.write(self.output, data)
            except OSError:  # the caller's stderr is closed: nothing to write to
                return
            data = data[written:]


def quieted() -> bool:
    """Whether torch's warnings of expected departures are dropped (`KEEP_VARIABLE` unset)."""
    return os.environ.get(KEEP_VARIABLE, "") not in ("1", "true", "yes")


def _names(line: bytes) -> tuple[str, str] | None:
    """The two processes a TensorPipe warning names, else None (any other line)."""
    if not line.startswith(b"[W"):
        return None
    return _torch.pipe_warning(line.decode(errors="replace"))


def _leak(line: bytes) -> bool:
    """Whether `line` is part of torch's report of the RRefs a worker left at its end."""
    return line.startswith((b"[W", b"Leaking RRef")) and _torch.rref_leak(
        line.decode(errors="replace")
    )
