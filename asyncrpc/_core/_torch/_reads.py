"""The patched reads of torch's Futures and RRefs: carried failures raised, torch's named.

A Python done-callback per call cost about 8% of a burst's throughput, so no
callback names a failed call: the read does. `tag_future` notes where a
Future's call went; torch's `wait`/`value` of a tagged Future pass a
RuntimeError through the namer, and any Future whose value is a carried
failure (a torch Future that was handed asyncrpc's reply) raises it. Two
ways of reading hand torch a Future without our tag, and are covered too:

- a callback (`then`, `add_done_callback`) gets a new Python wrapper when
  the caller kept none; the callback keeps the tagged one alive instead;
- `collect_all`/`wait_all` end at the first failed call, as torch's do for
  its own failed calls: a failure carried as a value is no error to torch's
  C++ collectAll, so for asyncrpc's calls the combined Future is ours.

`to_here()` and `local_value()` of an RRef raise carried failures too, and
name torch's by the owner. Every read marks its Future read (`_unread`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_rpc import PyRRef

from .. import _runtime
from .._errors import AsyncRPCError, CancelledError
from ._notes import Notes, cancel, combine, parts_of, set_canceller
from ._originals import UNSET_TIMEOUT, FutureType, future_add_done_callback, future_wait
from ._patches import Hooks, Patches
from ._unread import Unread

__all__ = ("patch_reads", "set_unwrap")


def set_unwrap(fut: Any, check: Callable[[Any], object]) -> None:
    """Run `check(value)` whenever `fut`'s value is read; an exception it raises propagates."""
    fut._set_unwrap_func(check)


def patch_reads(patches: Patches, hooks: Hooks) -> None:
    """Patch torch's Future and RRef reads (and Future's `cancel`) for the world of `hooks`."""
    # This world's parts, taken once: the patches are put back before the world ends.
    notes, unread = _runtime.part(Notes), _runtime.part(Unread)
    patch = patches.patch
    patch(FutureType, "wait", _named_read(FutureType.wait, hooks, notes, unread))
    patch(FutureType, "value", _named_read(FutureType.value, hooks, notes, unread))
    then = _held(FutureType.then, patches, notes, unread, chained=True)
    add_done_callback = _held(FutureType.add_done_callback, patches, notes, unread)
    patch(FutureType, "then", then)
    patch(FutureType, "add_done_callback", add_done_callback)
    collect_all = _early_collect_all(torch._C._collect_all, hooks, notes, unread)
    patch(torch._C, "_collect_all", collect_all)
    patch(PyRRef, "to_here", _checked_to_here(PyRRef.to_here, hooks))
    patch(PyRRef, "local_value", _checked_local_value(PyRRef.local_value, hooks))
    patch(FutureType, "cancel", cancel)


def _named_read(
    read: Callable[[Any], Any], hooks: Hooks, notes: Notes, unread: Unread
) -> Callable[[Any], Any]:
    tags, guards, watched = notes.tags, notes.guards, unread.watched

    @functools.wraps(read)
    def named_read(self: Any) -> Any:
        if watched:
            unread.mark(self)
        if guards:
            notes.check_guard(self)
        try:
            return hooks.check_value(read(self))
        except RuntimeError as exc:
            tag = tags.get(self)
            named = exc if tag is None else hooks.name_read(exc, tag)
            if named is exc:
                raise
            raise named from exc

    return named_read


def _held(
    add: Callable[..., Any], patches: Patches, notes: Notes, unread: Unread, chained: bool = False
) -> Callable[..., Any]:
    tags, cancellers, combined = notes.tags, notes.cancellers, notes.combined

    @functools.wraps(add)
    def add_callback(self: Any, callback: Callable[[Any], Any]) -> Any:
        ours = chained and (self in tags or self in cancellers or self in combined)
        if self in tags:
            callback = functools.partial(_call_held, callback, self)
            unread.mark(self)
        if ours:
            callback = functools.partial(_carry_cancel, patches, callback)
        child = add(self, callback)
        hooks = patches.hooks
        if ours and hooks is not None:
            child._set_unwrap_func(hooks.check_value)
            # torch completes its child: hand out one a cancel can complete
            if hooks.then_child is not None:
                return hooks.then_child(child, self)
            combine(child, [self])  # cancelling what `then` made cancels its source
        return child

    return add_callback


def _carry_cancel(patches: Patches, callback: Callable[[Any], Any], fut: Any) -> Any:
    # torch would wrap an error the callback lets through in a RuntimeError; asyncrpc's
    # own (a cancel, a dead worker, a failed call read in the callback) is carried as it
    # is, so the Future `then` made fails with that error, named as on every verb.
    try:
        return callback(fut)
    except AsyncRPCError as named:
        hooks = patches.hooks
        if hooks is None:
            raise
        return hooks.carry(named)


def _call_held(callback: Callable[[Any], Any], held: Any, fut: Any) -> Any:
    return callback(held)


def _early_collect_all(
    collect: Callable[[list[Any]], Any], hooks: Hooks, notes: Notes, unread: Unread
) -> Callable[..., Any]:
    tags, watched = notes.tags, unread.watched

    @functools.wraps(collect)
    def collect_all(futures: list[Any]) -> Any:
        for fut in futures if watched else ():
            unread.mark(fut)
        if not any(fut in tags for fut in futures):
            return collect(futures)
        early: Any = torch.futures.Future()
        early._set_unwrap_func(hooks.check_value)
        combine(early, futures)
        claim = threading.Lock()  # taken once: by the first failure, all values, or a cancel
        cancel_early = functools.partial(_cancel_collected, weakref.ref(early), claim, hooks)
        set_canceller(early, cancel_early)

        def settle(value: object) -> None:
            if claim.acquire(blocking=False):
                early.set_result(value)

        def on_member(fut: Any, _: Any) -> None:
            try:
                fut.wait()  # named, and a carried failure raised
            except Exception as exc:
                settle(hooks.carry(exc))

        def on_all(done: Any) -> None:
            try:
                settle(future_wait(done))
            except Exception as exc:
                settle(hooks.carry(exc))

        # Before torch's own callback: a failed member settles first, named. A
        # member already done is read here, and needs no callback.
        for fut in futures:
            if fut.done():
                on_member(fut, None)
            else:
                future_add_done_callback(fut, functools.partial(on_member, fut))
        future_add_done_callback(collect(futures), on_all)
        return early

    return collect_all


def _cancel_collected(early: weakref.ref[Any], claim: threading.Lock, hooks: Hooks) -> bool:
    # Cancelling collect_all's Future: failed with CancelledError at once, then its inputs.
    fut = early()
    if fut is None or not claim.acquire(blocking=False):
        return False
    inputs = parts_of(fut)
    error = CancelledError(f"this Future, collecting {len(inputs)} others, was cancelled")
    fut.set_result(hooks.carry(error))
    for source in inputs:
        cancel(source)
    return True


def _checked_to_here(to_here: Callable[..., Any], hooks: Hooks) -> Callable[..., Any]:
    @functools.wraps(to_here)
    def checked_to_here(self: Any, timeout: float = UNSET_TIMEOUT) -> Any:
        hooks.check_owner(self)
        try:
            value = to_here(self, timeout)
        except RuntimeError as exc:
            named = hooks.name_rref(exc, self)
            if named is exc:
                raise
            raise named from exc
        return hooks.check_value(value)

    return checked_to_here


def _checked_local_value(local_value: Callable[[Any], Any], hooks: Hooks) -> Callable[[Any], Any]:
    @functools.wraps(local_value)
    def checked_local_value(self: Any) -> Any:
        return hooks.check_value(local_value(self))

    return checked_local_value
