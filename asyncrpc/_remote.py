"""Handles to objects and modules that live on another worker.

`remote(to, cls, *args, **kwargs)` builds `cls(*args, **kwargs)` on worker
`to` and returns a handle that holds the RRef. The handle has a small,
closed set of verbs, each with an optional timeout::

    caller                                        owner (`to`)
    h = remote("w1", Counter, 5)  --- rpc ------>  Counter(5), kept by an OwnerRRef
    h.call("add", 2)              --- rpc ------>  getattr(obj, "add")(2) --> value back
    h.call_async("add", 2)        --- rpc ------>  same; a Future at the caller
    h.call_remote("add", 2)       --- rpc ------>  same; the value stays, an RRef back
    del h  (last handle gone)     --- delete --->  the object is released

Methods decorated with `async_execution` (or `async def` ones) run on the
owner without holding an RPC thread. Modules get `forward` /
`forward_async` and their parameters as RRefs for distributed autograd.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from . import _calls
from ._execution import async_execution
from ._futures import gather

__all__ = ["RemoteModule", "RemoteObject", "call_all", "remote"]

T = TypeVar("T")


# ---- owner side: these run on the worker that owns the object ------------------------


def _invoke(
    rref: rpc.RRef[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    return getattr(rref.local_value(), method)(*args, **kwargs)


@async_execution
def _invoke_async(
    rref: rpc.RRef[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Future[Any]:
    return getattr(rref.local_value(), method)(*args, **kwargs)  # type: ignore[no-any-return]


def _parameter_rrefs(rref: rpc.RRef[torch.nn.Module]) -> list[rpc.RRef[torch.Tensor]]:
    return [rpc.RRef(p) for p in rref.local_value().parameters()]


def _construct(cls: type[T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    return cls(*args, **kwargs)


# ---- caller side ---------------------------------------------------------------------


class RemoteObject(Generic[T]):
    """A handle to an object living on another worker; made by `asyncrpc.remote(to, cls, ...)`.

    Verbs: `call` (wait for the result), `call_async` (a Future),
    `call_remote` (the result stays on the owner; an RRef). RRef-style
    `rpc_sync()`, `rpc_async()`, `remote()` proxies and `to_here()` work too.
    The object is released when the last handle (and RRef to it) is gone.

    Example::

        counter = asyncrpc.remote("worker1", collections.Counter)
        counter.call("update", "abca")
        counter.call("most_common", 1)  # [('a', 2)]
    """

    def __init__(self, rref: rpc.RRef[T], cls: type[T]) -> None:
        self.rref = rref
        self.cls = cls

    @property
    def owner(self) -> str:
        """Name of the worker that holds the object."""
        return str(self.rref.owner().name)

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run `obj.method(*args, **kwargs)` on the owner and return the result."""
        invoker = self._invoker(method)
        call_args = (self.rref, method, args, kwargs)
        return _calls.call_sync(
            self.rref.owner(), invoker, call_args, None, timeout, self._label(method)
        )

    def call_async(
        self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Future[Any]:
        """Start `obj.method(*args, **kwargs)` on the owner; return a Future of the result."""
        invoker = self._invoker(method)
        call_args = (self.rref, method, args, kwargs)
        return _calls.call_async(
            self.rref.owner(), invoker, call_args, None, timeout, self._label(method)
        )

    def call_remote(
        self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> rpc.RRef[Any]:
        """Run `obj.method(*args, **kwargs)` on the owner, keep the result there; an RRef.

        As with torch's `remote`, `timeout` bounds creating the result on the
        owner; bound the wait for the value with `rref.to_here(timeout)`.
        """
        invoker = self._invoker(method)
        return _calls.remote_function(
            self.rref.owner(), invoker, args=(self.rref, method, args, kwargs), timeout=timeout
        )

    def to_here(self, timeout: float | None = None) -> T:
        """A copy of the remote object, fetched to this worker."""
        return self.rref.to_here(timeout=_calls.check_timeout("timeout", timeout))

    def rpc_sync(self, timeout: float | None = None) -> Any:
        """torch's RRef proxy: `h.rpc_sync().method(*args)` (same as `h.call`)."""
        return self.rref.rpc_sync(timeout=_calls.check_timeout("timeout", timeout))

    def rpc_async(self, timeout: float | None = None) -> Any:
        """torch's RRef proxy: `h.rpc_async().method(*args)` gives a Future."""
        return self.rref.rpc_async(timeout=_calls.check_timeout("timeout", timeout))

    def remote(self, timeout: float | None = None) -> Any:
        """torch's RRef proxy: `h.remote().method(*args)` gives an RRef."""
        return self.rref.remote(timeout=_calls.check_timeout("timeout", timeout))

    def _invoker(self, method: str) -> Any:
        attr = getattr(self.cls, method, None)
        if not callable(attr):
            names = [n for n in dir(self.cls) if not n.startswith("_")]
            close = difflib.get_close_matches(method, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            what = "has no method" if attr is None else "has an attribute, not a method, named"
            raise AttributeError(
                f"{self.cls.__name__} {what} {method!r}; {hint}"
                f"pass a method name: handle.call('name', *args)"
            )
        return _invoke_async if hasattr(attr, "_wrapped_async_rpc_function") else _invoke

    def _label(self, method: str) -> str:
        return f"{self.cls.__qualname__}.{method}()"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self.cls.__qualname__} on {self.owner!r}>"


M = TypeVar("M", bound=torch.nn.Module)


class RemoteModule(RemoteObject[M]):
    """A handle to an `nn.Module` on another worker; calling it runs `forward` there.

    No TorchScript involved. Gradients flow back through
    `torch.distributed.autograd`, and `parameter_rrefs()` feeds a
    `DistributedOptimizer`.

    Example::

        net = asyncrpc.remote("worker1", torch.nn.Linear, 4, 1)
        with torch.distributed.autograd.context() as ctx_id:
            loss = net(torch.randn(8, 4)).sum()
            torch.distributed.autograd.backward(ctx_id, [loss])
    """

    def forward(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run the module on its owner and return the output."""
        return self.call("forward", *args, timeout=timeout, **kwargs)

    __call__ = forward

    def forward_async(
        self, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Future[Any]:
        """Run the module on its owner; a Future of the output."""
        return self.call_async("forward", *args, timeout=timeout, **kwargs)

    def parameter_rrefs(self, timeout: float | None = None) -> list[rpc.RRef[torch.Tensor]]:
        """RRefs to the module's parameters, for `DistributedOptimizer`."""
        owner = self.rref.owner()
        return list(_calls.rpc_sync(owner, _parameter_rrefs, args=(self.rref,), timeout=timeout))


def remote(to: Any, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
    """Create an object on worker `to` and return a handle; or run a function there (an RRef).

    With a class, `remote(to, cls, *args, **kwargs)` builds `cls(*args,
    **kwargs)` on `to` and returns a `RemoteObject` (a `RemoteModule` for an
    `nn.Module`). With a function it is torch's `remote(to, fn, args=(),
    kwargs={}, timeout=...)` and returns an RRef to the result.

    Example::

        net = asyncrpc.remote("worker1", torch.nn.Linear, 4, 1)
        print(net(torch.ones(2, 4)))
        rref = asyncrpc.remote("worker2", torch.zeros, args=((3,),))
        print(rref.to_here())
    """
    if not isinstance(fn, type):
        fn_args, fn_kwargs = _function_arguments(args, kwargs)
        return _calls.remote_function(to, fn, fn_args, fn_kwargs, timeout)
    ctor_args, ctor_kwargs = _constructor_arguments(fn, args, kwargs)
    rref = _calls.remote_function(
        to, _construct, args=(fn, ctor_args, ctor_kwargs), timeout=timeout
    )
    handle = RemoteModule if issubclass(fn, torch.nn.Module) else RemoteObject
    return handle(rref, fn)


def _function_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """torch's `remote(to, fn, args=None, kwargs=None)`, positionally or by keyword."""
    unexpected = set(kwargs) - {"args", "kwargs"}
    if len(args) > 2 or unexpected:
        got = f"keyword {sorted(unexpected)[0]!r}" if unexpected else f"{len(args)} arguments"
        raise TypeError(
            f"remote(to, fn, ...) with a function takes args=(...) and kwargs={{...}}, got "
            f"{got}; write remote(to, fn, args=(x,)), or pass a class to build an object: "
            f"remote(to, Cls, *ctor_args)"
        )
    named = dict(zip(("args", "kwargs"), args, strict=False))
    if set(named) & set(kwargs):
        raise TypeError(f"remote: {sorted(set(named) & set(kwargs))[0]} given twice")
    named.update(kwargs)
    return named.get("args"), named.get("kwargs")


def _constructor_arguments(
    cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # torch style `remote(to, Cls, args=(...), kwargs={...})` still works, unless
    # the constructor itself takes parameters named `args` / `kwargs`.
    torch_style = set(kwargs) <= {"args", "kwargs"} and kwargs and not args
    if torch_style and not _accepts(cls, kwargs):
        ctor_args = tuple(kwargs.get("args") or ())
        ctor_kwargs = dict(kwargs.get("kwargs") or {})
        return ctor_args, ctor_kwargs
    return args, kwargs


def _accepts(cls: type, kwargs: Mapping[str, Any]) -> bool:
    import inspect

    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return all(name in params for name in kwargs)


def call_all(
    handles: Iterable[RemoteObject[Any]],
    method: str,
    *args: Any,
    timeout: float | None = None,
    **kwargs: Any,
) -> Future[list[Any]]:
    """Call `method` on every handle at once; a Future of the results, in order.

    Fails as soon as one call fails.

    Example::

        shards = [asyncrpc.remote(n, Shard, i) for i, n in enumerate(ctx.workers("ps"))]
        sizes = asyncrpc.call_all(shards, "size").wait()
    """
    items: Sequence[RemoteObject[Any]] = list(handles)
    for h in items:
        if not isinstance(h, RemoteObject):
            raise TypeError(
                f"call_all expects handles from asyncrpc.remote(to, cls, ...), got "
                f"{type(h).__name__} {h!r:.60}"
            )
    return gather([h.call_async(method, *args, timeout=timeout, **kwargs) for h in items])
