"""`spawn`: an object built on a worker (or on the least-loaded one), and `call_all`.

spawn(to, cls, *args)
  to None or a role ──> _placement: the least-loaded candidate
  ──── remote: construct(cls, args) ───> the owner builds it (counted for placement)
  a factory, not a class? ask the owner what it built
  a RemoteObject (RemoteModule for a module); with max_restarts, its recipe kept
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar, overload

import torch
from torch.futures import Future

from ._actor import actor_options, sendable_class
from ._core import _calls, _torch
from ._core._futures import gather
from ._family import Recipe, construct
from ._handles import RemoteModule, RemoteObject, type_of
from ._placement import place

__all__ = ("call_all", "spawn")

T = TypeVar("T")
M = TypeVar("M", bound=torch.nn.Module)
P = ParamSpec("P")


@overload
def spawn(
    to: _calls.Target | None, cls: Callable[P, M], /, *args: P.args, **kwargs: P.kwargs
) -> RemoteModule[M]: ...
@overload
def spawn(
    to: _calls.Target | None, cls: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
) -> RemoteObject[T]: ...
def spawn(to: _calls.Target | None, cls: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Build `cls(*args, **kwargs)` on worker `to`; a handle to the new object.

    `to` is a worker (name, rank or WorkerInfo), a role (`"actor"`: one of
    its workers), or None (any worker): then the least-loaded candidate
    gets it, by fewest objects `spawn` built there still alive, then fewest
    calls running, then not the caller, then lowest rank; `h.owner` says
    which. `cls` is a class or any factory (a function, `functools.partial`);
    an `nn.Module` gives a `RemoteModule`. Every argument goes to `cls`: set
    call options on the handle, `spawn(...).options(timeout=5)`. A Future
    among them is waited for here, and its value sent; an ObjectRef arrives
    as a ref.

    Example::

        net = asyncrpc.spawn("worker1", torch.nn.Linear, 4, 1)
        print(net(torch.ones(2, 4)))
        counters = [asyncrpc.spawn(None, collections.Counter) for _ in range(4)]
    """
    placed = place(to)
    _calls.check("spawn", placed, cls, None, None, None)
    args, kwargs = _waited(args), dict(zip(kwargs, _waited(tuple(kwargs.values())), strict=True))
    sent = sendable_class(cls)
    rref = _calls.send_remote(_calls.check("spawn", placed, construct, (sent, args, kwargs),
                                           None, None, cls))  # fmt: skip
    if placed is not to:  # built before the next placement counts it
        _torch.rref_future(rref).wait()
    to = placed
    made = _made_class(cls)
    if made is None:  # a factory: ask the owner what it built (waits for it)
        made = _calls.call_sync(_calls.check("spawn", to, type_of, (rref,), None, None, cls))
    is_module = made is not None and issubclass(made, torch.nn.Module)
    handle = (RemoteModule if is_module else RemoteObject)(rref, made)
    restarts = actor_options(made).max_restarts
    if restarts:  # kept to build it again where its owner is replaced
        handle._family.recipe = Recipe(sent, args, kwargs, restarts)
    return handle


def _made_class(factory: Callable[..., Any]) -> type | None:
    """The class a factory builds, where it can be told without running it."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory if isinstance(factory, type) else None


def call_all(
    handles: Iterable[RemoteObject[Any]], method: str, /, *args: Any, **kwargs: Any
) -> Future[list[Any]]:
    """Call `method` on every handle at once; a Future of the results, in order.

    Fails as soon as one call fails.

    Example::

        shards = [asyncrpc.spawn(n, Shard, i) for i, n in enumerate(ctx.workers("ps"))]
        sizes = asyncrpc.call_all(shards, "size").wait()
    """
    items: Sequence[RemoteObject[Any]] = list(handles)
    for h in items:
        if not isinstance(h, RemoteObject):
            raise TypeError(
                f"call_all expects handles from asyncrpc.spawn(to, cls, ...), got "
                f"{type(h).__name__} {h!r:.60}"
            )
    return gather([h.call_async(method, *args, **kwargs) for h in items])


def _waited(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """`values` with each Future replaced by its value (a constructor runs once, here)."""
    if not any(isinstance(v, _torch.FutureType) for v in values):
        return values
    return tuple(v.wait() if isinstance(v, _torch.FutureType) else v for v in values)
