"""How a launcher (`asyncrpc-launch --restart worker`, `--elastic`) takes a stopping signal.

The first SIGINT, SIGTERM or SIGHUP becomes `Stopped` in the launcher's main
thread, wherever it is but inside `Signals.held` (where a worker is started
and listed: it is raised as that ends); later ones are held while it stops
its workers (or, on a node other than node 0 of an elastic world, lets them
leave).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from types import FrameType

__all__ = ("Signals", "Stopped", "say_stopped", "stop_on_signals", "stop_reason")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """A signal asked this launcher to stop."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


class Signals:
    """The launcher's stopping signals: the first becomes `Stopped`, unless it is `held`."""

    def __init__(self) -> None:
        self.stopping = False
        self.holding = 0
        self.pending: int | None = None

    def take(self, number: int, frame: FrameType | None) -> None:
        if self.stopping or self.pending is not None:
            return  # later ones are held while the launcher stops
        if self.holding:
            self.pending = number  # raised once the held section ends
            return
        self.stopping = True
        raise Stopped(number)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No `Stopped` inside: a process started here is known before a signal can stop us.

        `subprocess.Popen` forks, then returns; `Stopped` raised between the two
        would leave a worker that no one stops. A signal that comes inside is
        raised as the section ends.
        """
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
            if not self.holding and self.pending is not None and not self.stopping:
                self.stopping = True
                raise Stopped(self.pending)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[Signals]:
    """Turn the first stopping signal into `Stopped` in the main thread; later ones are held."""
    signals = Signals()
    before = {number: signal.signal(number, signals.take) for number in _STOP_SIGNALS}
    try:
        yield signals
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
