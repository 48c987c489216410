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

The Reply is also the Future's tag (`_torch.tag_future`: where the call
went, for naming and cancelling), so a call costs one claim token and one
Python callback more than torch's own (benchmarks/call_overhead.py measures
it). `rpc_sync` has nothing to cancel and reads torch's Future as before.
"""

from __future__ import annotations

from typing import Any

from torch.futures import Future

from . import _activity, _cancel, _torch, _watcher
from ._errors import CancelledError
from ._failures import Failure, hold, label_of, name_failure
from ._futures import new_future

__all__ = ["Reply", "cancelled_here"]


class Reply:
    """Settles `future` once: with the reply of torch's Future, or with a cancel.

    Read as the call's `Sent` (worker, label, callee, key) by whoever names
    or cancels it.
    """

    __slots__ = ("__weakref__", "_token", "callee", "future", "key", "label", "outgoing", "worker")

    def __init__(self, sent: _cancel.Sent) -> None:
        self.worker, self.label, self.callee, self.key = sent
        self.future: Future[Any] = new_future()
        self._token = [True]  # popped once, by whoever settles (atomic under the GIL)
        _torch.tag_future(self.future, self)
        self.outgoing = _activity.sent(self.worker, self.label, self.key)

    def pending(self) -> bool:
        """True until the reply or a cancel has settled the Future."""
        return bool(self._token)

    def _settle(self) -> Future[Any] | None:
        try:
            self._token.pop()
        except IndexError:
            return None
        future = self.future
        # The Future's tag is this Reply: holding the Future after it is settled
        # would keep it alive for good (and torch may hold this Reply for long).
        del self.future
        return future

    def __call__(self, reply: Any) -> None:
        """torch's Future of the call completed: copy its outcome in, named."""
        future = self._settle()
        if future is None:
            return  # cancelled first: the value is dropped
        ok, outcome = _torch.outcome(reply)
        if not ok:
            outcome = hold(name_failure(outcome, self.worker, self.label))
        _activity.ended(self.outgoing, failed=not ok or type(outcome) is Failure)
        future.set_result(outcome)

    def cancel(self) -> bool:
        """Fail the Future with CancelledError now; then ask the callee to stop the call."""
        future = self._settle()
        if future is None:
            return False
        _activity.ended(self.outgoing, failed=False)
        future.set_result(hold(cancelled_here(self.worker, self.label)))
        if self.key:  # torch's operators run without a key: nothing to stop there
            _watcher.request(_cancel.Sent(self.worker, self.label, self.callee, self.key))
        return True


def cancelled_here(worker: str, label: object) -> CancelledError:
    """The caller's CancelledError for a call it cancelled."""
    return CancelledError(
        f"the call to {label_of(label)} on worker {worker!r} was cancelled", worker
    )
