"""How a launcher (`asyncrpc-launch --restart worker`, `--elastic`) takes a stopping signal.

The first SIGINT, SIGTERM or SIGHUP becomes `Stopped` in the launcher's main
thread, wherever it is; later ones are held while it stops its workers (or,
on a node other than node 0 of an elastic world, lets them leave).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from types import FrameType

__all__ = ("Stopped", "say_stopped", "stop_on_signals", "stop_reason")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """A signal asked this launcher to stop."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the first stopping signal into `Stopped` in the main thread; later ones are held."""
    stopping = False

    def stop(number: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise Stopped(number)

    before = {number: signal.signal(number, stop) for number in _STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


def stop_reason(number: int) -> str:
    name = signal.Signals(number).name
    return "interrupted (Ctrl-C)" if number == signal.SIGINT else f"ended by {name}"


def say_stopped(number: int) -> int:
    print(f"asyncrpc-launch: {stop_reason(number)}; the workers were stopped",
          file=sys.stderr, flush=True)  # fmt: skip
    return 128 + number
