"""What asyncrpc notes on torch Futures, and the cancel it reaches through them.

Held weakly, by Future, in the world's `Notes` part (`_runtime`):

- tags (`tag_future`): where a Future's call went; a read that fails passes
  torch's error through `Hooks.name_read` with it, and cancel asks the callee;
- guards (`guard_reads`): a check that raises before a read would block on a
  Future that can never complete (a Batch call before its Batch is sent), or
  before a blocking read only (not an `await`) that would wait for ever (a
  coroutine's own worker's coroutine, read on that worker's event loop);
- what a Future is made of (`combine`: gather, chain, with_timeout, wait_all):
  its inputs' guards are its guard, and its cancel cancels them;
- cancellers (`set_canceller`): what cancelling a Future of asyncrpc's own does.

`cancel` is also torch Futures' `cancel()` while a world is installed.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .. import _runtime
from ._patches import Patches

__all__ = (
    "Notes",
    "cancel",
    "check_guard",
    "combine",
    "guard_reads",
    "parts_of",
    "set_canceller",
    "tag_future",
    "tag_of",
)


class Notes:
    """The world's notes on torch Futures, each table keyed weakly by the Future."""

    __slots__ = ("__weakref__", "cancellers", "combined", "guards", "tags")

    def __init__(self) -> None:
        self.tags: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        # Per Future: its check, and whether only a blocking read (not an await) runs it.
        self.guards: weakref.WeakKeyDictionary[Any, tuple[Callable[[], None], bool]] = (
            weakref.WeakKeyDictionary()
        )
        # A Future made of others: its inputs, which its guard checks and its cancel() cancels.
        self.combined: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
        # Futures cancelled by a function of their own (an async def's Task, say). Held
        # weakly when a bound method: a value that reaches its key would keep it forever.
        self.cancellers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def check_guard(self, fut: Any, blocking: bool = True) -> None:
        """Raise what a guard of `fut`, or of a Future it is made of, raises.

        `blocking`: the read would block this thread (False: an `await`).
        """
        if not self.guards or fut.done():
            return
        found = self.guards.get(fut)
        if found is not None and (blocking or not found[1]):
            found[0]()
        for source in self.combined.get(fut, ()):
            self.check_guard(source, blocking)


def tag_future(fut: Any, tag: object) -> None:
    """Pass `tag` to the namer when reading `fut` raises torch's RuntimeError."""
    _runtime.part(Notes).tags[fut] = tag


def tag_of(fut: Any) -> Any:
    """`fut`'s tag (`tag_future`), or None: where the call behind it went."""
    return _runtime.part(Notes).tags.get(fut)


def guard_reads(fut: Any, check: Callable[[], None], blocking_only: bool = False) -> None:
    """Run `check()` (which may raise) before any read of `fut` that would block.

    With `blocking_only`, not before an `await` of it.
    """
    _runtime.part(Notes).guards[fut] = (check, blocking_only)


def combine(fut: Any, inputs: Sequence[Any]) -> None:
    """Record that `fut` is made of `inputs`: their guards are its guard, cancel reaches them."""
    _runtime.part(Notes).combined[fut] = list(inputs)


def parts_of(fut: Any) -> list[Any]:
    """The Futures `fut` is made of (`combine`), or none."""
    return list(_runtime.part(Notes).combined.get(fut, ()))


def check_guard(fut: Any, blocking: bool = True) -> None:
    """Raise what a guard of `fut`, or of a Future it is made of, raises."""
    _runtime.part(Notes).check_guard(fut, blocking)


def set_canceller(fut: Any, cancel: Callable[[], bool]) -> None:
    """Make `cancel()` what cancelling `fut` does (it returns whether anything was stopped).

    A bound method is held weakly (its object must not hold `fut` for good);
    any other callable must not reach `fut` (use a weakref to it).
    """
    own = weakref.WeakMethod(cancel) if inspect.ismethod(cancel) else cancel
    _runtime.part(Notes).cancellers[fut] = own


def cancel(fut: Any) -> bool:
    """Cancel the work behind `fut`; False when it is done or not asyncrpc's to cancel.

    An asyncrpc call asks its callee to stop (`Hooks.cancel_call`); a local
    Future runs its own canceller; a combined Future cancels its inputs.
    """
    if fut.done():
        return False
    notes = _runtime.part(Notes)
    own = notes.cancellers.get(fut)
    if isinstance(own, weakref.WeakMethod):
        own = own()
    if own is not None:
        return bool(own())
    inputs = notes.combined.get(fut)
    if inputs is not None:
        return any([cancel(source) for source in inputs])  # a list: every input is asked
    tag, hooks = notes.tags.get(fut), _runtime.part(Patches).hooks
    if tag is None or hooks is None:
        return False
    own_cancel = getattr(tag, "cancel", None)  # a call's Reply settles its own Future
    if own_cancel is not None:
        return bool(own_cancel())
    return hooks.cancel_call(tag)
