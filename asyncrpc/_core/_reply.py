"""The caller's Future of one call: torch's reply copied in, unless a cancel came first.

`cancel()` must return True only when the Future it was given will fail
with `CancelledError`, and that Future must then fail at once, whatever the
callee does. torch's own Future of a call completes when the reply arrives,
and it cannot be completed early from Python (torch's C++ would complete it
a second time), so the Future an asyncrpc verb returns is one of its own,
and whoever claims it first settles it::

    torch's Future ── reply (value, Failure or torch's error) ──> Reply: claim? ── yes ─> out
    fut.cancel() ──────────────────────────────────────────────> Reply: claim? ── yes ─> out
                                                                        │       CancelledError,
                                                                        no      then the callee
                                                                        └─> False  is asked to stop

One claim flag and one Python callback per call (benchmarks/call_overhead.py
measures it). `rpc_sync` has nothing to cancel and reads torch's Future
as before.
"""

from __future__ import annotations

import threading
from typing import Any

from torch.futures import Future

from . import _cancel, _torch
from ._errors import CancelledError
from ._failures import hold, label_of, name_failure
from ._futures import new_future

__all__ = ["Reply", "cancelled_here"]


class Reply:
    """Settles `future` once: with the reply of torch's Future, or with a cancel."""

    __slots__ = ("__weakref__", "_lock", "_settled", "future", "sent")

    def __init__(self, sent: _cancel.Sent) -> None:
        self.future: Future[Any] = new_future()
        self.sent = sent
        self._lock = threading.Lock()
        self._settled = False
        _torch.set_canceller(self.future, self.cancel)  # held weakly there

    def _claim(self) -> bool:
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            return True

    def __call__(self, reply: Any) -> None:
        """torch's Future of the call completed: copy its outcome in, named."""
        if not self._claim():
            return  # cancelled first: the value is dropped
        ok, outcome = _torch.outcome(reply)
        if not ok:
            sent = self.sent
            outcome = hold(name_failure(outcome, sent.worker, sent.label))
        self.future.set_result(outcome)

    def cancel(self) -> bool:
        """Fail the Future with CancelledError now; then ask the callee to stop the call."""
        if not self._claim():
            return False
        future = self.future
        # torch's Future keeps this Reply until the callee answers, which may be
        # never: the caller's Future must not wait with it.
        del self.future
        future.set_result(hold(cancelled_here(self.sent)))
        if self.sent.key:  # torch's operators run without a key: nothing to stop there
            _cancel.request(self.sent)
        return True


def cancelled_here(sent: _cancel.Sent) -> CancelledError:
    """The caller's CancelledError for a call it cancelled."""
    return CancelledError(
        f"the call to {label_of(sent.label)} on worker {sent.worker!r} was cancelled",
        sent.worker,
    )
