"""Failures nobody read: a watched Future that fails and is dropped unread is reported once.

The world's `Unread` part (`_runtime`) holds, weakly by Future, what is
known of each watched one; the patched reads mark it read (`Unread.mark`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from .. import _runtime
from ._originals import future_add_done_callback, future_wait

__all__ = ("Unread", "watch_unread")


class _Watched:
    """What is known of one watched Future: its error, and whether anyone read it."""

    __slots__ = ("dropped", "error", "read", "report")

    def __init__(self, report: Callable[[BaseException], None]) -> None:
        self.report: Callable[[BaseException], None] | None = report
        self.error: BaseException | None = None
        self.dropped = self.read = False

    def settle(self, fut: Any) -> None:
        try:
            future_wait(fut)
        except Exception as error:  # the failure itself is what gets reported
            # Its traceback holds this frame, and so `fut`: it would never be dropped.
            self.error = error.with_traceback(None)
            if self.dropped:
                self.emit()

    def drop(self) -> None:
        self.dropped = True
        if self.error is not None:
            self.emit()

    def emit(self) -> None:
        report, self.report = self.report, None
        if report is not None and not self.read and self.error is not None:
            report(self.error)


class Unread:
    """The world's watched Futures (`watch_unread`), each held weakly."""

    __slots__ = ("__weakref__", "watched")

    def __init__(self) -> None:
        self.watched: weakref.WeakKeyDictionary[Any, _Watched] = weakref.WeakKeyDictionary()

    def mark(self, fut: Any) -> None:
        """`fut` was read: a failure of it is nobody's to report."""
        state = self.watched.get(fut)
        if state is not None:
            state.read = True


def watch_unread(fut: Any, report: Callable[[BaseException], None]) -> None:
    """Call `report(error)` once if `fut` fails and is dropped without being read.

    A read is `wait`, `value`, `then`, `add_done_callback` or `collect_all`;
    it counts whether it comes before or after the failure.
    """
    state = _Watched(report)
    _runtime.part(Unread).watched[fut] = state
    weakref.finalize(fut, state.drop)
    future_add_done_callback(fut, state.settle)
