"""How the boundary changes torch: each patch remembered once, put back newest first.

The world's `Patches` part (`_runtime`) holds what was there before each
patch and the `Hooks` of the world that installed them (asyncrpc's side of
the patches: how to name a failure, carry one, cancel a call...). Closing the
part, at the world's end or by `uninstall`, puts torch back as it was.
`install_await` gives torch Futures an `__await__`, for a world or for good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import _runtime
from ._originals import FutureType

__all__ = ("Hooks", "Patches", "install_await")

_ABSENT = object()  # what `Patches.patch` remembers for a name the holder did not have


class Hooks(NamedTuple):
    """asyncrpc's side of the patches (given by the world that installs them)."""

    await_future: Callable[[Any], Any]  # Future.__await__
    name_read: Callable[[BaseException, Any], BaseException]  # a tagged Future's failure
    name_rref: Callable[[BaseException, Any], BaseException]  # to_here's failure, by RRef
    check_value: Callable[[object], object]  # a value read: raise a carried failure
    carry: Callable[[BaseException], object]  # a failure as a value to set on a Future
    cancel_call: Callable[[Any], bool]  # ask a tagged call's callee to stop it
    handoff: Callable[..., Any]  # the `asyncrpc-store://` rendezvous handler
    check_owner: Callable[[Any], None]  # before to_here: raise if the owner process died
    # An RRef being sent (the RRef), or received (its owner's and sender's torch ids):
    # raise if the owner (or the sender) process died; True in a world that heals.
    check_fork: Callable[..., bool]
    # An RRef pickled for a call to torch id `to`: how to send it without torch's fork
    # messages (a reduce tuple), or None for torch's own way; RRefs to hold go in `keep`
    # (None: a reply, which holds nothing after it is sent).
    reduce_rref: Callable[[Any, int, list[Any] | None], Any]
    # What `then` on an asyncrpc Future returns in place of torch's child, which a
    # cancel could not complete early: `then_child(child, source)`; None: the child.
    then_child: Callable[[Any, Any], Any] | None


class Patches:
    """The world's patches of torch: what each replaced, and the hooks they call."""

    __slots__ = ("__weakref__", "hooks", "lock", "patched")

    def __init__(self) -> None:
        # (id of the holder, name) -> (holder, what it held, or _ABSENT), in patch order
        self.patched: dict[tuple[int, str], tuple[Any, Any]] = {}
        self.lock = threading.RLock()  # `install` patches while holding it
        self.hooks: Hooks | None = None  # while installed

    def patch(self, holder: Any, name: str, value: Any) -> None:
        """Set `holder.name` (`holder[name]` for a dict), remembering what was there once."""
        with self.lock:
            if isinstance(holder, dict):
                self.patched.setdefault((id(holder), name), (holder, holder.get(name, _ABSENT)))
                holder[name] = value
            else:
                was = vars(holder).get(name, _ABSENT)
                self.patched.setdefault((id(holder), name), (holder, was))
                setattr(holder, name, value)

    def close(self) -> None:
        """Put back everything patched, newest first, and forget the hooks (again: nothing)."""
        with self.lock:
            for (_, name), (holder, original) in reversed(list(self.patched.items())):
                if isinstance(holder, dict):
                    if original is _ABSENT:
                        holder.pop(name, None)
                    else:
                        holder[name] = original
                elif original is _ABSENT:
                    delattr(holder, name)
                else:
                    setattr(holder, name, original)
            self.patched.clear()
            self.hooks = None


def install_await(method: Callable[[Any], Any], keep: bool = False) -> None:
    """Give torch Futures an `__await__` (kept if torch ever ships its own).

    With `keep` it stays after `uninstall` (a user asked for it by hand).
    """
    patches = _runtime.part(Patches)
    key = (id(FutureType), "__await__")
    if keep:
        with patches.lock:
            if vars(FutureType).get("__await__") is method:
                patches.patched.pop(key, None)  # already ours: now for good
            elif not hasattr(FutureType, "__await__"):
                FutureType.__await__ = method  # type: ignore[attr-defined]
        return
    if hasattr(FutureType, "__await__"):
        return
    with patches.lock:
        if not hasattr(FutureType, "__await__"):
            patches.patch(FutureType, "__await__", method)
