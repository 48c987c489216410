"""Handles to objects and modules that live on another worker.

`spawn(to, cls, *args, **kwargs)` builds `cls(*args, **kwargs)` on worker
`to` and returns a handle holding the RRef; `RemoteObject(rref)` wraps an
RRef that torch code already holds. A handle has a small, closed set of
verbs, and every call goes through the same path as `rpc_sync`::

    caller                                          owner (`to`)
    h = spawn("w1", Counter, 5)     ─── remote ───>  Counter(5), kept by an OwnerRRef
    h.call("add", 2)                ─── rpc ──────>  obj.add(2) ──> value back
    h.call_async("add", 2)          ─── rpc ──────>  same; a Future at the caller
    h.call_remote("add", 2)         ─── remote ───>  same; the value stays, an RRef back
    h.stream("gen", 2)              ─── pulls ────>  obj.gen(2) yields; items come in batches
    h.options(timeout=5).call(...)      (call options never mix with the method's own)
    del h  (last handle gone)       ─── delete ───>  the object is released

Methods decorated with `async_execution`, and `async def` methods, run on the
owner without holding an RPC thread. torch's proxies on a handle
(`h.rpc_sync().method(...)`) are these verbs in torch's shape. Modules get
`forward`/`forward_async` and their parameters as RRefs for distributed
autograd. A constructor that raised leaves a Failure as the object: every
call on the handle raises that error.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from ._actor import (
    Retryable,
    actor_options,
    check_retries,
    check_retryable,
    method_options,
    sendable_class,
)
from ._core import _calls, _hooks, _torch
from ._core._errors import (
    CallTimeoutError,
    CancelledError,
    ObjectLostError,
    SerializationError,
    WorkerLeftError,
    WorkerUnreachableError,
)
from ._core._failures import hold
from ._core._futures import new_future
from ._core._mailbox import invoke, no_method, skip_turn
from ._core._objects import has_refs
from ._core._promised import lend, release
from ._core._stream import DEFAULT_WINDOW, Stream, check_window, resolving_first
from ._family import Family, family_for, my_name
from ._retry import await_notice, call_async_retrying, call_retrying

__all__ = ("RemoteModule", "RemoteObject", "type_of")

T = TypeVar("T")
M = TypeVar("M", bound=torch.nn.Module)
P = ParamSpec("P")


# ---- owner side: these run on the worker that owns the object ------------------------


def _method(obj: object, name: str) -> Callable[..., Any]:
    attr = getattr(obj, name, None)
    if not callable(attr):
        raise AttributeError(no_method(type(obj), name, attr))
    return attr  # type: ignore[no-any-return]


def _invoke_stream(
    name: str, args: tuple[Any, ...], kw: dict[str, Any], rref: rpc.RRef[Any]
) -> Any:
    """A handle's stream: the generator its method returns (see `_core._stream`).

    The RRef comes last, as `invoke`'s does (an unpicklable argument fails first).
    Its ObjectRefs and Futures passed arrive as values, as for the other verbs.
    """
    method = _method(rref.local_value(), name)
    if has_refs(args, kw):
        return resolving_first(method, args, kw)
    return method(*args, **kw)


def _parameter_rrefs(rref: rpc.RRef[torch.nn.Module]) -> list[rpc.RRef[torch.Tensor]]:
    return [rpc.RRef(p) for p in rref.local_value().parameters()]


def type_of(rref: rpc.RRef[Any]) -> type:
    """On the owner: the class of the object `rref` holds."""
    return type(rref.local_value())


def _read_for_unread(call: _calls.Call, ticket: list[Any], fut: Future[Any]) -> None:
    """A handle's call ended on torch's side: if it never reached the object's mailbox
    (or may not have), its turn is given back (`_give_back`)."""
    try:
        ok, value = _torch.outcome(fut)
        error = value if not ok else getattr(value, "error", None)
    except Exception as exc:  # its read raised
        error = exc
    if isinstance(error, BaseException):
        with contextlib.suppress(Exception):  # a callback of torch's: it must not raise
            _give_back(call, ticket, error)


def _give_back(call: _calls.Call, ticket: list[Any], error: BaseException) -> None:
    """A call its caller gave up on before knowing it reached the object's mailbox (the
    owner could not unpickle it; it timed out; it was cancelled): its number there is
    given back, or the handle's next calls would wait for it. The owner ignores this
    for a call that has arrived; one that arrives after never runs."""
    cause = error.__cause__ or error
    gave_up = isinstance(error, (CallTimeoutError, CancelledError))
    if not gave_up and _torch.failure_kind(cause) not in ("unreadable", "timeout"):
        return
    skip = _calls.check("call", call.worker, skip_turn, (ticket, call.args[-1]), None, None,  # type: ignore[index]
                        "a turn given back")  # fmt: skip
    with contextlib.suppress(Exception):  # the owner is gone: nobody waits for the turn
        _calls.send(skip, cancellable=False)


# ---- caller side ---------------------------------------------------------------------


class RemoteObject(Generic[T]):
    """A handle to an object living on another worker.

    Made by `asyncrpc.spawn(to, cls, ...)`, or from an RRef torch code holds:
    `RemoteObject(rref)`. Verbs: `call` (wait for the result), `call_async`
    (a Future), `call_remote` (the result stays on the owner; an RRef), and
    `options(timeout=...)` for a handle whose calls use other options. The
    object is released when the last handle (and RRef to it) is gone.

    Example::

        counter = asyncrpc.spawn("worker1", collections.Counter)
        counter.call("update", "abca")
        counter.call("most_common", 1)  # [('a', 2)]
        counter.options(timeout=5).call("total")
    """

    def __init__(
        self,
        rref: rpc.RRef[T],
        cls: type[T] | None = None,
        *,
        timeout: float = _calls.UNSET_RPC_TIMEOUT,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if not isinstance(rref, _torch.PyRRef):
            raise TypeError(
                f"{type(self).__name__} wraps an RRef, got {type(rref).__name__} {rref!r:.60}; "
                f"to build an object on a worker use asyncrpc.spawn(to, cls, *args)"
            )
        self.cls = cls
        self._timeout = _calls.check_timeout("timeout", timeout)
        self._window = check_window(window)
        self._family = family_for(rref)  # every copy of this handle here shares it
        self._mailbox = actor_options(cls).for_mailbox()
        self._retries: tuple[int | None, Retryable | None] = (None, None)  # None: the method's

    @property
    def rref(self) -> rpc.RRef[T]:
        """The RRef of the object now (a new one once a restart rebuilt it)."""
        return self._family.rref  # type: ignore[no-any-return]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        family = state.pop("_family")
        # A copy elsewhere keeps its own order, and asks the creator after a restart.
        state["_origin"] = family.origin or (my_name(), family.key)
        state["_rref"] = family.rref
        state["cls"] = sendable_class(self.cls)  # the handle carries the options anyway
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_family"] = family_for(state.pop("_rref"), state.pop("_origin"))
        vars(self).update(state)

    @property
    def owner(self) -> str:
        """Name of the worker that holds the object.

        In a world that heals, `ObjectLostError` once that worker's process
        died (its replacement does not have the object), unless the object
        restarts (`asyncrpc.actor(max_restarts=N)`): then it is rebuilt there.
        """
        return self._target()[1]

    def _target(self) -> tuple[Any, str]:
        """(the object's RRef now, its owner's name), rebuilt first if it may restart."""
        rref = self._family.rref
        what = f"the {self._what()} of this handle"
        if self._family.suspected is rref:  # a call to it met a death: wait for the news
            await_notice(rref)
        try:
            return rref, _hooks.owner_of(rref, what)
        except ObjectLostError as lost:
            rref = self._family.revive(rref, lost)
            return rref, _hooks.owner_of(rref, what)

    def options(
        self,
        *,
        timeout: float | None = None,
        window: int | None = None,
        max_retries: int | None = None,
        retry_exceptions: Retryable | None = None,
    ) -> RemoteObject[T]:
        """A handle to the same object whose calls use these options (others unchanged).

        `timeout` bounds each call (as torch's: -1 the world's default, 0 none);
        `window` bounds the items in flight of the handle's streams;
        `max_retries` and `retry_exceptions` replace the method's own
        (`asyncrpc.method`) for `call` and `call_async` (see its docs).

        Example::

            counter.options(timeout=2.5).call("add", 1)
            fetcher.options(max_retries=3, retry_exceptions=(IOError,)).call("get", url)
        """
        copy = type(self)(
            self.rref,
            self.cls,
            timeout=self._timeout if timeout is None else timeout,
            window=self._window if window is None else window,
        )
        copy._family = self._family  # the same handle: one order, one object
        copy._retries = self._retries
        if max_retries is not None:
            copy._retries = (check_retries("max_retries", max_retries), copy._retries[1])
        if retry_exceptions is not None:
            copy._retries = (copy._retries[0], check_retryable(retry_exceptions))
        return copy

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run `obj.method(*args, **kwargs)` on the owner and return the result.

        Retried as its method (`asyncrpc.method`) or `options` say.
        """
        left, retry_on = self._retry_options(method)
        if left == 0:
            return self._call_once(method, args, kwargs)
        once = functools.partial(self._call_once, method, args, kwargs)
        return call_retrying(once, lambda: self._family.rref, left, retry_on, self._seconds())

    def call_async(self, method: str, /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Start `obj.method(*args, **kwargs)` on the owner; a Future of the result.

        Retried as its method (`asyncrpc.method`) or `options` say.
        """
        left, retry_on = self._retry_options(method)
        if left == 0:
            return self._send_once(method, args, kwargs)
        once = functools.partial(self._send_once, method, args, kwargs)
        return call_async_retrying(
            once, lambda: self._family.rref, left, retry_on, self._seconds()
        )

    def _seconds(self) -> float:
        """This handle's timeout in seconds (0: none); with retries it bounds them all."""
        return _calls.seconds_of(self._timeout)

    def _call_once(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   timeout: float | None = None) -> Any:  # fmt: skip
        call, ticket = self._call(method, args, kwargs, timeout)
        try:
            return _calls.call_sync(call, sending=self._family.sending(ticket))
        except WorkerUnreachableError:
            self._family.suspect(call.args[-1])  # type: ignore[index]
            raise
        except (SerializationError, CallTimeoutError) as exc:
            _give_back(call, ticket, exc)
            raise

    def _send_once(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   timeout: float | None = None) -> Future[Any]:  # fmt: skip
        call, ticket = self._call(method, args, kwargs, timeout)
        with self._family.sending(ticket):
            fut = _calls.send(call)
        _torch.add_callback(fut, functools.partial(_read_for_unread, call, ticket))
        if self._family.restarts_here():  # a death it meets: the next call waits for the heal
            return _noting_death(fut, self._family, call.args[-1])  # type: ignore[index]
        return fut

    def _retry_options(self, method: str) -> tuple[int, Retryable]:
        own = method_options(self.cls, method) if isinstance(method, str) else None
        left, retry_on = self._retries
        return (
            left if left is not None else (own.max_retries if own else 0),
            retry_on if retry_on is not None else (own.retry_exceptions if own else False),
        )

    def call_remote(self, method: str, /, *args: Any, **kwargs: Any) -> rpc.RRef[Any]:
        """Run `obj.method(*args, **kwargs)` on the owner, keep the result there; an RRef.

        As with torch's `remote`, the timeout bounds creating the result on the
        owner; bound the wait for the value with `rref.to_here(timeout)`.
        """
        call, ticket = self._call(method, args, kwargs)
        with self._family.sending(ticket):
            rref = _calls.send_remote(call)
        # A result that could not be made (arguments the owner could not unpickle, a
        # timeout) gives the call's turn back, as for the other verbs.
        read = functools.partial(_read_for_unread, call, ticket)
        _torch.add_callback(_torch.rref_future(rref), read)
        return rref

    def stream(self, method: str, /, *args: Any, **kwargs: Any) -> Stream[Any]:
        """Iterate the items of generator method `obj.method(*args, **kwargs)` as they come.

        As `asyncrpc.stream`; the window is the handle's (`options(window=...)`).

        Example::

            for frame in env.stream("rollout", steps=100):
                buffer.append(frame)
        """
        self._check_method(method)  # a wrong name fails here, at once
        label = f"{self.cls.__qualname__ if self.cls else 'object'}.{method}()"
        args, kwargs, lent = lend(args, kwargs)
        try:
            call = _calls.check("stream", self.owner, _invoke_stream, (method, args, kwargs,
                                self.rref), None, self._timeout, label, lent=lent)  # fmt: skip
        except BaseException:
            release(lent)
            raise
        return Stream(call, self._window)

    def to_here(self) -> T:
        """A copy of the remote object, fetched to this worker."""
        value: T = _calls.call_sync(self._call_on_owner(_local_value, "to_here()"))
        return value

    # torch's RRef proxies, in their shape but on this handle's verbs, so their
    # calls take the same path (async def methods, failures, options). The RRef's
    # own proxies (`h.rref.rpc_sync()`) stay torch's.
    def rpc_sync(self, timeout: float = _calls.UNSET_RPC_TIMEOUT) -> Any:
        """`h.rpc_sync().method(*args)` is `h.call("method", *args)` (torch's proxy shape)."""
        return _Proxy(self._timed(timeout).call)

    def rpc_async(self, timeout: float = _calls.UNSET_RPC_TIMEOUT) -> Any:
        """`h.rpc_async().method(*args)` is `h.call_async("method", *args)`: a Future."""
        return _Proxy(self._timed(timeout).call_async)

    def remote(self, timeout: float = _calls.UNSET_RPC_TIMEOUT) -> Any:
        """`h.remote().method(*args)` is `h.call_remote("method", *args)`: an RRef."""
        return _Proxy(self._timed(timeout).call_remote)

    def _timed(self, timeout: float) -> RemoteObject[T]:
        return self if timeout == _calls.UNSET_RPC_TIMEOUT else self.options(timeout=timeout)

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              timeout: float | None = None) -> tuple[_calls.Call, list[Any]]:  # fmt: skip
        """One method call, checked, through the owner's mailbox; its ticket is numbered
        as it is sent (`Family.sending`). `timeout`: the handle's, unless given."""
        self._check_method(method)
        seconds = self._timeout if timeout is None else timeout
        ticket: list[Any] = [0, -1, self._mailbox, 0.0]  # stream and number: as it is sent
        label = f"{self.cls.__qualname__ if self.cls else 'object'}.{method}()"
        rref, owner = self._target()
        args, kwargs, lent = lend(args, kwargs)  # Futures passed go as values or Promised
        try:
            try:
                call = _calls.check("call", owner, invoke, (method, args, kwargs, ticket, rref),
                                    None, seconds, label, lent=lent)  # fmt: skip
            except WorkerUnreachableError as exc:  # its owner died, and is being replaced
                if isinstance(exc, WorkerLeftError) or not self._family.may_restart():
                    raise
                await_notice(rref)  # the death known here: the object is rebuilt next
                rref, owner = self._target()
                call = _calls.check("call", owner, invoke, (method, args, kwargs, ticket, rref),
                                    None, seconds, label, lent=lent)  # fmt: skip
        except BaseException:
            release(lent)
            raise
        # How long it may wait for its turn: a call whose caller gave up never starts.
        ticket[3] = _calls.seconds_of(call.seconds)
        return call, ticket

    def _call_on_owner(self, func: Callable[..., Any], label: str) -> _calls.Call:
        rref, owner = self._target()
        return _calls.check("call", owner, func, (rref,), None, self._timeout, label)

    def _check_method(self, method: str) -> None:
        if not isinstance(method, str):
            raise TypeError(
                f"the method is named by a string, got {type(method).__name__} {method!r:.60}; "
                f"write handle.call('name', *args)"
            )
        if self.cls is None:
            return  # the owner checks the name
        attr = getattr(self.cls, method, None)
        if not callable(attr):
            raise AttributeError(no_method(self.cls, method, attr))

    def _what(self) -> str:
        return f"{self.cls.__qualname__} object" if self.cls is not None else "object"

    def __repr__(self) -> str:
        what = self.cls.__qualname__ if self.cls is not None else "an object"
        try:  # no restart for a repr
            where = repr(_hooks.owner_of(self._family.rref, "the object"))
        except WorkerUnreachableError as lost:
            where = f"{lost.name!r}, whose process died (the object is lost)"
        return f"<{type(self).__name__} of {what} on {where}>"


class _Proxy:
    """torch's RRef proxy shape: `proxy.method(*args)` runs `run("method", *args)`."""

    __slots__ = ("_run",)

    def __init__(self, run: Callable[..., Any]) -> None:
        self._run = run

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        return functools.partial(self._run, name)


def _noting_death(fut: Future[Any], family: Family, rref: Any) -> Future[Any]:
    """`fut`'s outcome, given once a death it met is noted (so the next call waits for it)."""
    out = new_future()
    _torch.combine(out, [fut])  # cancelling `out` cancels the call

    def settle(done: Future[Any]) -> None:
        try:
            out.set_result(done.wait())
        except WorkerUnreachableError as exc:
            family.suspect(rref)
            out.set_result(hold(exc))
        except BaseException as exc:
            out.set_result(hold(exc))

    fut.add_done_callback(settle)
    return out


def _local_value(rref: rpc.RRef[T]) -> T:
    value: T = rref.local_value()
    return value


class RemoteModule(RemoteObject[M]):
    """A handle to an `nn.Module` on another worker; calling it runs `forward` there.

    No TorchScript involved. Gradients flow back through
    `torch.distributed.autograd`, and `parameter_rrefs()` feeds a
    `DistributedOptimizer`.

    Example::

        net = asyncrpc.spawn("worker1", torch.nn.Linear, 4, 1)
        with torch.distributed.autograd.context() as ctx_id:
            loss = net(torch.randn(8, 4)).sum()
            torch.distributed.autograd.backward(ctx_id, [loss])
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module on its owner and return the output."""
        return self.call("forward", *args, **kwargs)

    __call__ = forward

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run the module on its owner; a Future of the output."""
        return self.call_async("forward", *args, **kwargs)

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        """RRefs to the module's parameters, for `DistributedOptimizer`."""
        return list(_calls.call_sync(self._call_on_owner(_parameter_rrefs, "parameter_rrefs()")))
