"""Retrying a handle's calls, as Ray's `max_task_retries` and `retry_exceptions` do.

A call is sent again when it failed with an error its method (or the
handle's `options`) says to retry, until `max_retries` more attempts (-1:
no limit) have been made:

- an exception the method raised: when `retry_exceptions` is True, or a
  tuple the error is an instance of;
- the death of its callee, in a world that heals: once the world knows of
  the death, the next attempt rebuilds the object on the replacement
  (`_family`; its `max_restarts` decides) and goes there. Such a call may
  have run before it met the death: at least once, then, and only where asked.

Never retried: a cancel, a timeout, an argument or reply that cannot be
pickled, a worker that left. The handle's timeout bounds the call with all
its attempts: each is sent with the time left, and when none is left the
call fails with `CallTimeoutError`, caused by the last attempt's error.
Otherwise the caller sees the last attempt's error::

    attempt ── fails ──> retryable, attempts left? ── no ──> the Future fails with it
                              │ yes
                              ├─ a death: wait until the world knows (an actor thread)
                              ├─ no time left: CallTimeoutError (from the last error)
                              └─ send again (a new number in the handle's order)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from torch.futures import Future

from ._actor import Retryable
from ._core import _cancel, _hooks, _polling, _runtime, _torch, _world
from ._core._errors import (
    CallTimeoutError,
    CancelledError,
    ObjectLostError,
    RemoteError,
    WorkerLeftError,
    WorkerUnreachableError,
)
from ._core._failures import hold
from ._core._futures import new_future
from ._core._mailbox import Mailboxes

__all__ = ("call_async_retrying", "call_retrying")

_NOTICE_S = 15.0  # how long a retry waits for the world to learn of its callee's death
Attempt = Callable[[float], Future[Any]]  # one attempt, sent with this timeout


class Budget:
    """A call's timeout over all its attempts: what the next one may take (0: no bound)."""

    __slots__ = ("attempts", "deadline", "last", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds if seconds > 0 else None
        self.attempts = 0
        self.last: BaseException | None = None  # the error of the attempt before

    def next(self, last: BaseException | None) -> float:
        """The timeout of the next attempt; CallTimeoutError (from `last`) if none is left."""
        self.attempts += 1
        self.last = last
        if self.deadline is None:
            return 0.0
        left = self.deadline - time.monotonic()
        if left > 0:
            return left
        raise self.spent(last, self.attempts - 1) from last

    def final(self, error: Exception) -> Exception:
        """What the caller sees of an attempt's error that ends the call."""
        if isinstance(error, CallTimeoutError) and self.last is not None:
            # The last attempt had only the time left: what failed before tells more.
            spent = self.spent(self.last, self.attempts - 1)
            spent.__cause__ = self.last
            return spent
        return error

    def spent(self, last: BaseException | None, tried: int) -> CallTimeoutError:
        return CallTimeoutError(
            f"the call did not succeed within its timeout ({self.seconds:g} s) in {tried} "
            f"attempt{'s' if tried != 1 else ''}; the last failed with {_gist(last)}; give "
            f"the handle a longer timeout (options(timeout=...)) or fewer retries",
            getattr(last, "name", "") or "",
        )


def _gist(error: BaseException | None) -> str:
    """An error in one line (a remote one's text ends with the line that says what it was)."""
    kind = type(error).__name__
    lines = str(error).strip().splitlines()
    line = lines[-1][:200] if lines else ""
    return line if line.startswith(kind) else f"{kind}: {line}"


def is_death(error: BaseException) -> bool:
    """The callee's process died (not a removal, not a cancel)."""
    return isinstance(error, WorkerUnreachableError) and not isinstance(error, WorkerLeftError)


def retryable(error: BaseException, retry_on: Retryable) -> bool:
    """Whether a call that failed with `error` may be sent again (see the module doc)."""
    if isinstance(error, CancelledError):
        return False
    if is_death(error):
        return _world.heals()
    if not isinstance(error, RemoteError) or retry_on is False:
        return False
    return retry_on is True or isinstance(error, retry_on)


def await_notice(rref: Any) -> None:
    """Wait until this worker knows that `rref`'s owner died (the next attempt rebuilds)."""

    def known() -> bool:
        try:
            _hooks.owner_of(rref, "the object")
        except ObjectLostError:
            return True
        return False

    _polling.within(known, _NOTICE_S)


def call_retrying(attempt: Callable[[float], Any], rref: Callable[[], Any], left: int,
                  retry_on: Retryable, seconds: float) -> Any:  # fmt: skip
    """Run `attempt(timeout)` until it returns, or fails past what may be retried.

    `seconds` (0: none) bounds all the attempts together.
    """
    budget = Budget(seconds)
    timeout = budget.next(None)
    while True:
        sent_to = rref()
        try:
            return attempt(timeout)
        except Exception as error:
            if left == 0 or not retryable(error, retry_on):
                final = budget.final(error)
                if final is error:
                    raise
                raise final from final.__cause__
            left = left - 1 if left > 0 else left
            if is_death(error):
                await_notice(sent_to)
            timeout = budget.next(error)


def call_async_retrying(attempt: Attempt, rref: Callable[[], Any], left: int,
                        retry_on: Retryable, seconds: float) -> Future[Any]:  # fmt: skip
    """`attempt(timeout)`'s Future, sent again on failures that may be retried; one Future.

    `seconds` (0: none) bounds all the attempts together.
    """
    retrying = _Retrying(attempt, rref, left, retry_on, Budget(seconds))
    retrying.start(None)
    return retrying.out


class _Retrying:
    """One call and its attempts; cancelling it cancels the attempt running and stops."""

    __slots__ = (
        "__weakref__",
        "attempt",
        "budget",
        "cancelled",
        "current",
        "left",
        "lock",
        "out",
        "retry_on",
        "rref",
        "sent_to",
        "settled",
    )  # fmt: skip

    def __init__(self, attempt: Attempt, rref: Callable[[], Any], left: int,
                 retry_on: Retryable, budget: Budget) -> None:  # fmt: skip
        self.attempt, self.rref, self.left, self.retry_on = attempt, rref, left, retry_on
        self.budget = budget
        self.out = new_future()
        self.lock = threading.Lock()
        self.current: Future[Any] | None = None
        self.sent_to: Any = None
        self.cancelled = self.settled = False
        _torch.set_canceller(self.out, self.cancel)

    def start(self, last: BaseException | None) -> None:
        """Send the next attempt (`last`: the error of the one before, if any)."""
        try:
            timeout = self.budget.next(last)
            self.sent_to = self.rref()
            fut = self.attempt(timeout)
        except Exception as error:
            self._settle(hold(error))
            return
        with self.lock:
            self.current = fut
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[Any]) -> None:
        try:
            self._settle(fut.wait())
            return
        except Exception as exc:
            error = exc
        with self.lock:
            again = not self.cancelled and self.left != 0 and retryable(error, self.retry_on)
            if again and self.left > 0:
                self.left -= 1
        if not again:
            self._settle(hold(self.budget.final(error)))
        elif is_death(error):  # waits: not on the thread that completed the Future
            self._later(error)
        else:
            self.start(error)

    def _after_death(self, error: BaseException) -> None:
        await_notice(self.sent_to)
        self.start(error)

    def _later(self, error: BaseException) -> None:
        try:
            _runtime.part(Mailboxes).submit(lambda: self._after_death(error))
        except RuntimeError as exc:  # the world ended
            self._settle(hold(exc))

    def _settle(self, value: Any) -> None:
        with self.lock:
            if self.settled:
                return
            self.settled = True
        self.out.set_result(value)

    def cancel(self) -> bool:
        with self.lock:
            if self.settled:
                return False
            self.cancelled = True
            current = self.current
        if current is None or not _cancel.cancel(current):  # between two attempts
            self._settle(hold(CancelledError("the call was cancelled between two attempts", "")))
        return True
