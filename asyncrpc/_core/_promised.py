"""Futures passed as arguments: a pending result goes from the worker computing it to the
callee that uses it, not through the caller.

A top-level argument that is a Future (of `rpc_async`, a handle's
`call_async`, a Batch, or any torch Future) is sent as a `Promised`: where
its call runs and under which key, and who lent it. The callee runs the call
once each promised value is there (`_objects.resolving`, as for ObjectRefs),
holding no RPC thread while it waits::

    caller                          W: runs g, key k                C: runs f
    x = rpc_async(W, g) ──────────> g running
    rpc_async(C, f, args=(x,))
      x done:    its value inline ───────────────────────────────────> f(value)
      x pending: Promised(W, k, caller, n) ──────────────────────────> take: give(k)?
      `Lent` holds x as n, until f's reply    <──────── give(k) ──────
                                    g ends: its reply ─┬─> caller (x, as ever)
                                                       └──────────────> f(value)
      W runs no call k (it ended, or has not arrived yet, or x came from
      no single call): C asks the caller instead
      <──────────────────────────────────── lent_value(n) ────────────
      x's outcome ───────────────────────────────────────────────────> f(value)

A failed Future fails the call that took it, with that failure; the call
does not run. The caller still gets its own Future's value.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.futures import Future

from . import _cancel, _runtime, _torch, _world
from ._errors import ObjectLostError
from ._failures import Failure, hold
from ._futures import completed, new_future

__all__ = ("Lent", "Promised", "lend", "release_after", "take")


class Promised:
    """A Future passed as an argument, as it travels: where its value is made, who lent it.

    `worker` and `key`: the call whose reply it is (None and 0 when it is no
    single call's); `lender` and `number`: the caller that passed it, and
    its number there (`Lent`).
    """

    __slots__ = ("key", "lender", "number", "worker")

    def __init__(self, worker: str | None, key: int, lender: str, number: int) -> None:
        self.worker, self.key, self.lender, self.number = worker, key, lender, number

    def __reduce__(self) -> tuple[Any, ...]:
        return (Promised, (self.worker, self.key, self.lender, self.number))

    def __repr__(self) -> str:
        where = f"made on {self.worker!r}, " if self.worker else ""
        return f"Promised({where}lent by {self.lender!r})"


class Lent:
    """The Futures this process passed as arguments, by number, until their calls reply
    (a `_runtime` part)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.futures: dict[int, Future[Any]] = {}
        self.numbers = itertools.count(1)


def lend(
    args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> tuple[Any, Any, tuple[int, ...]]:
    """(args, kwargs, numbers): each top-level Future a value (done) or a `Promised`, and
    the numbers lent (release them once the call has replied: `release_after`)."""
    if not _holds_futures(args, kwargs):
        return args, kwargs, ()
    numbers: list[int] = []

    def swap(value: Any) -> Any:
        if not isinstance(value, _torch.FutureType):
            return value
        if value.done():
            ok, outcome = _torch.outcome(value)
            if ok and type(outcome) is not Failure:
                return outcome  # nothing to wait for: the value goes as it is
        promised = _promise(value)
        numbers.append(promised.number)
        return promised

    args = None if args is None else tuple(swap(a) for a in args)
    kwargs = None if kwargs is None else {k: swap(v) for k, v in kwargs.items()}
    return args, kwargs, tuple(numbers)


def _holds_futures(args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> bool:
    future = _torch.FutureType
    return any(isinstance(a, future) for a in args or ()) or any(
        isinstance(v, future) for v in (kwargs or {}).values()
    )


def _promise(fut: Any) -> Promised:
    lent = _runtime.part(Lent)
    number = next(lent.numbers)
    with lent.lock:
        lent.futures[number] = fut
    tag = _torch.tag_of(fut)  # the Reply or Sent of the one call behind it, if any
    key = getattr(tag, "key", 0)
    worker = getattr(tag, "worker", None) if key else None
    return Promised(worker, key, _torch.own_name(), number)


def release_after(fut: Future[Any], numbers: tuple[int, ...]) -> None:
    """Let go of the Futures lent as `numbers` once `fut` (the call's reply) is done: the
    callee has read them by then, or given up."""
    _torch.add_callback(fut, lambda _: release(numbers))


def release(numbers: tuple[int, ...]) -> None:
    """Let go of the Futures lent as `numbers` now."""
    lent = _runtime.part(Lent)
    with lent.lock:
        for number in numbers:
            lent.futures.pop(number, None)


# ---- the callee's side ----------------------------------------------------------------


def take(promised: Promised) -> Future[Any]:
    """A Future of the promised value, or of its Failure: from the worker that runs its
    call if it still does, else from the caller that lent it."""
    out: Future[Any] = new_future()
    if promised.worker is None:
        _ask_lender(promised, out)
        return out

    def given(done: Future[Any]) -> None:
        ok, answer = _torch.outcome(done)
        if ok and answer[0]:
            out.set_result(answer[1])
        else:  # no such call runs there now, or it cannot be reached: ask the caller
            _ask_lender(promised, out)

    _ask(promised.worker, give, promised.key, given)
    return out


def _ask_lender(promised: Promised, out: Future[Any]) -> None:
    def answered(done: Future[Any]) -> None:
        ok, answer = _torch.outcome(done)
        out.set_result(answer[0] if ok else hold(_lost(promised, answer)))

    _ask(promised.lender, lent_value, promised.number, answered)


def _ask(name: str, func: Callable[[int], Future[Any]], number: int,
         then: Callable[[Future[Any]], None]) -> None:  # fmt: skip
    """`func(number)` on worker `name` (here, when it is this process), then `then`."""
    try:
        if name == _torch.own_name():
            fut = func(number)
        else:  # no timeout: a call may run long, and a dead worker fails the ask
            fut = _torch.send_python(_world.target(name), func, (number,), {}, 0.0, True)
    except Exception as exc:  # the worker left the world, or the world ended
        fut = new_future()
        fut.set_exception(exc)
    _torch.add_callback(fut, then)


def give(key: int) -> Future[tuple[bool, Any]]:
    """On the worker running call `key`: (True, its reply) once it ends, or (False, None)
    at once when no such call runs here."""
    taken = _cancel.taker(key)
    if taken is None:
        return completed((False, None))
    return taken.then(lambda done: (True, outcome(done)))


def lent_value(number: int) -> Future[tuple[Any]]:
    """On the caller: (the outcome of the Future it lent as `number`,): a Failure if it
    failed, or if the call it was passed to has already replied."""
    lent = _runtime.part(Lent)
    with lent.lock:
        fut = lent.futures.get(number)
    if fut is None:
        gone = ObjectLostError(
            f"a Future passed as an argument by {_torch.own_name()!r} is no longer kept there "
            f"(the call it was passed to has already replied or was given up)",
            _torch.own_name(),
        )
        return completed((hold(gone),))
    out: Future[tuple[Any]] = new_future()
    _torch.add_callback(fut, lambda done: out.set_result((outcome(done),)))
    return out


def outcome(done: Future[Any]) -> Any:
    """A done Future's value, or its failure as a Failure (sent in a tuple, a Failure is
    not raised by the read of the reply that carries it)."""
    ok, value = _torch.outcome(done)
    return value if ok or isinstance(value, Failure) else hold(value)


def _lost(promised: Promised, cause: BaseException) -> ObjectLostError:
    error = ObjectLostError(
        f"the value of a Future passed as an argument could not be read from "
        f"{promised.lender!r}, the worker that passed it: {type(cause).__name__}: {cause}",
        promised.lender,
    )
    error.__cause__ = cause
    return error
