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
from ._errors import ObjectLostError, SerializationError
from ._failures import Failure, hold
from ._futures import Settle, completed, new_future

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
        # The answers callees wait for (`lent_value`), by number: given up when released.
        self.asked: dict[int, list[Settle]] = {}
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
        done = value.done()
        if done:
            read = outcome(value)
            if type(read) is not Failure:
                return read  # nothing to wait for: the value goes as it is
        # Failed already: its caller has the failure, whatever its callee does next.
        promised = _promise(value, of_call=not done)
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


def _promise(fut: Any, of_call: bool) -> Promised:
    lent = _runtime.part(Lent)
    number = next(lent.numbers)
    with lent.lock:
        lent.futures[number] = fut
    tag = _torch.tag_of(fut) if of_call else None  # the Reply or Sent of its one call
    key = getattr(tag, "key", 0)
    worker = getattr(tag, "worker", None) if key else None
    return Promised(worker, key, _torch.own_name(), number)


def release_after(fut: Future[Any], numbers: tuple[int, ...]) -> None:
    """Let go of the Futures lent as `numbers` once `fut` (the call's reply) is done: the
    callee has read them by then, or given up."""
    _torch.add_callback(fut, lambda _: release(numbers))


def release(numbers: tuple[int, ...]) -> None:
    """Let go of the Futures lent as `numbers` now; a callee still waiting for one of them
    is answered that it was given up (its call was cancelled or timed out)."""
    lent = _runtime.part(Lent)
    waiting: list[Settle] = []
    with lent.lock:
        for number in numbers:
            lent.futures.pop(number, None)
            waiting += lent.asked.pop(number, ())
    for answer in waiting:  # answered once: by the Future, or by its release
        answer.resolve((hold(_given_up()),))


def _given_up() -> ObjectLostError:
    return ObjectLostError(
        f"a Future passed as an argument by {_torch.own_name()!r} is no longer kept there "
        f"(the call it was passed to has already replied, or was cancelled or timed out)",
        _torch.own_name(),
    )


# ---- the callee's side ----------------------------------------------------------------


def take(promised: Promised) -> Future[Any]:
    """A Future of the promised value, or of its Failure: from the worker that runs its
    call if it still does, else from the caller that lent it."""
    out: Future[Any] = new_future()
    if promised.worker is None:
        _ask_lender(promised, out)
        return out

    def given(done: Future[Any]) -> None:
        answer = outcome(done)
        if type(answer) is tuple and answer[0]:
            out.set_result(answer[1])
        else:  # no such call runs there now, or it cannot be reached: ask the caller
            _ask_lender(promised, out)

    _ask(promised.worker, give, promised.key, given)
    return out


def _ask_lender(promised: Promised, out: Future[Any]) -> None:
    def answered(done: Future[Any]) -> None:
        answer = outcome(done)
        if type(answer) is tuple:
            out.set_result(answer[0])
        else:
            out.set_result(hold(_lost(promised, answer.error)))

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
    answer = Settle()
    with lent.lock:
        fut = lent.futures.get(number)
        if fut is not None:
            lent.asked.setdefault(number, []).append(answer)
    if fut is None:
        return completed((hold(_given_up()),))

    def settle(done: Future[Any]) -> None:
        with lent.lock:
            asked = lent.asked.get(number, [])
            if answer in asked:
                asked.remove(answer)
                if not asked:
                    lent.asked.pop(number, None)
        answer.resolve((outcome(done),))

    _torch.add_callback(fut, settle)
    return answer.future


def outcome(done: Any) -> Any:
    """A done Future's value, or its failure as a Failure (sent in a tuple, a Failure is
    not raised by the read of the reply that carries it). Any Future: a read that raises
    what torch would not (a CancelledError, a user's exception) is a failure too."""
    try:
        ok, value = _torch.outcome(done)
    except Exception as exc:
        return hold(exc)
    return value if ok or isinstance(value, Failure) else hold(value)


def _lost(promised: Promised, cause: BaseException) -> Exception:
    said = str(cause).splitlines()[0] if str(cause) else ""
    error: Exception
    if "pickle" in str(cause).lower():
        error = SerializationError(
            f"the value of a Future passed as an argument could not be sent from "
            f"{promised.lender!r}, the worker that passed it: {type(cause).__name__}: {said}; "
            f"have the Future hold tensors, numbers, strings and containers of them, or "
            f"objects of module-level classes"
        )
    else:
        error = ObjectLostError(
            f"the value of a Future passed as an argument could not be read from "
            f"{promised.lender!r}, the worker that passed it: {type(cause).__name__}: {said}",
            promised.lender,
        )
    error.__cause__ = cause
    return error
