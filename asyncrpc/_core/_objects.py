"""Objects that travel once: `put` keeps a value on this worker; its ObjectRef reads it anywhere.

An ObjectRef is a torch RRef to the value on its owner, the worker that put
it, so torch's forks count who holds it: the owner frees the value once no
ref to it is left anywhere (in a world that heals, refs cross calls as
handles do, `_forks`). Any other process reads a ref's value at most once
while it holds a ref to it: torch's RRef fetch, run on a thread of
asyncrpc's so that no RPC thread waits for it::

    owner: ref = put(v)              borrower: get(ref), or ref as a top-level argument
      RRef(v) ─── ref in a call ───>   held here (`Fetched` counts this process's refs)
                                       first read: to_here on an `asyncrpc-fetch` thread
      <─────────── fetch ───────────   later reads: the value fetched, not fetched again
      v ────────── value ──────────>   last ref here gone: the value fetched is let go
      last ref anywhere gone: torch frees v on the owner

A call whose top-level arguments hold refs runs once they are all here
(`resolving`); a ref inside a list or dict arrives as a ref (Ray's rule).
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from . import _activity, _hooks, _runtime, _torch
from ._errors import ObjectLostError, SerializationError, WorkerUnreachableError
from ._failures import Failure
from ._futures import await_future, check_seconds, completed, gather, new_future, with_timeout
from ._kept import Kept, size_of
from ._promised import Promised, outcome, take

__all__ = ("Fetched", "ObjectRef", "fetch", "get", "has_refs", "put", "resolving")

T = TypeVar("T")
_FETCH_THREADS = 8  # fetches of values of other workers at once, per process

Key = tuple[int, int]


class ObjectRef(Generic[T]):
    """A value kept by the worker that `put` it; `asyncrpc.get(ref)` reads it anywhere.

    Pass it in calls (a top-level argument arrives as its value), results,
    handles' calls and streams; the value lives while a ref to it does.

    Example::

        ref = asyncrpc.put(torch.ones(3))
        asyncrpc.rpc_sync("worker1", torch.sum, args=(ref,))  # tensor(3.)
        asyncrpc.get(ref)  # tensor([1., 1., 1.])
    """

    __slots__ = ("__weakref__", "_key", "_rref")

    def __init__(self, rref: Any) -> None:
        self._rref = rref
        self._key: Key = _torch.rref_id(rref)
        if not rref.is_owner():  # a borrower: what it fetches lives while it holds refs
            _runtime.part(Fetched).hold(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ObjectRef, (self._rref,))  # torch forks the RRef as it pickles it

    @property
    def owner(self) -> str:
        """The name of the worker that holds the value (the one that put it)."""
        try:
            return _hooks.owner_of(self._rref, "the value of this ObjectRef")
        except WorkerUnreachableError as gone:  # its name, all the same
            return gone.name or "a worker no longer in the world"

    def __await__(self) -> Generator[Any, None, T]:
        """`await ref` in a coroutine: its value, fetched without blocking the loop."""
        return (yield from await_future(fetch(self)))  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"ObjectRef(owner={self.owner!r}, id={self._key[0]}:{self._key[1]})"


def put(value: T) -> ObjectRef[T]:
    """Keep a copy of `value`, as it is now, on this worker; an ObjectRef that reads it
    anywhere in the world.

    The copy is made once (its CPU tensors into shared memory, which readers
    on this machine map; the rest by pickling, so `value` must pickle, as
    for a call), and stays here however many calls and workers use the ref;
    each other process fetches it once. Later changes to `value` are not in
    it: put the new version.

    Example::

        ref = asyncrpc.put(model.state_dict())
        for actor in actors:
            actor.call_async("load_state_dict", ref)  # each actor gets the dict
    """
    if isinstance(value, ObjectRef):
        raise TypeError(
            f"put: got {value!r}, which is a ref already; pass it on as it is (refs travel), "
            f"or put asyncrpc.get(ref) to keep a copy here"
        )
    try:
        kept, size = _torch.snapshot_shared(value)
    except Exception as exc:
        raise SerializationError(
            f"put: the value could not be copied to keep ({type(exc).__name__}: {exc}); put "
            f"tensors, numbers, strings and containers of them, or objects of module-level "
            f"classes (keep other objects on their worker: asyncrpc.spawn)"
        ) from exc
    return ObjectRef(rpc.RRef(Kept(kept, size)))


class Fetched:
    """This process's fetched values, by ref, while it holds refs to them (a `_runtime` part)."""

    def __init__(self) -> None:
        # Reentrant: a ref's finalizer (`_let_go`) may run in a gc pass on a thread that
        # holds the lock already (one allocating a Future here).
        self.lock = threading.RLock()
        self.values: dict[Key, Future[Any]] = {}
        self.holders: dict[Key, int] = {}
        self.sizes: dict[Key, int] = {}  # of the values read (counted in `_activity.held`)
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.machine: str | None = None

    def host(self) -> str:
        """Which shared memory this process can map (`_torch.host_key`), read once."""
        if self.machine is None:
            self.machine = _torch.host_key()
        return self.machine

    def hold(self, ref: ObjectRef[Any]) -> None:
        key = ref._key
        with self.lock:
            self.holders[key] = self.holders.get(key, 0) + 1
        weakref.finalize(ref, self._let_go, key)

    def _let_go(self, key: Key) -> None:
        with self.lock:
            left = self.holders.get(key, 1) - 1
            if left > 0:
                self.holders[key] = left
                return
            self.holders.pop(key, None)
            self.values.pop(key, None)
            size = self.sizes.pop(key, None)
        if size is not None:
            _activity.holding(0, 0, -1, -size)

    def read(self, key: Key, value: object) -> None:
        """A value of `key` was fetched: counted while this process holds a ref to it."""
        size = size_of(value)
        with self.lock:
            if key not in self.values or key in self.sizes:
                return  # let go already, while it was read
            self.sizes[key] = size
        _activity.holding(0, 0, 1, size)

    def fetch(self, ref: ObjectRef[Any]) -> Future[Any]:
        with self.lock:
            fut = self.values.get(ref._key)
            if fut is not None:
                return fut
            fut = self.values[ref._key] = new_future()
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    _FETCH_THREADS, thread_name_prefix="asyncrpc-fetch"
                )
            pool = self.pool
        try:
            pool.submit(_read, ref, fut)
        except RuntimeError as exc:  # the world has ended
            fut.set_result(Failure(_lost(ref, exc)))
        return fut

    def close(self) -> None:
        with self.lock:
            pool, self.pool = self.pool, None
            self.values.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _read(ref: ObjectRef[Any], fut: Future[Any]) -> None:
    try:  # named in a trace (asyncrpc.trace records every thread with torch's profiler)
        with torch.profiler.record_function(f"fetch ObjectRef {ref._key[0]}:{ref._key[1]}"):
            value = _read_shared(ref)
            if value is _NOT_SHARED:
                value = ref._rref.to_here()
    except ObjectLostError as exc:
        fut.set_result(Failure(exc))
    except Exception as exc:
        fut.set_result(Failure(_lost(ref, exc)))
    else:
        _runtime.part(Fetched).read(ref._key, value)
        fut.set_result(value)


_NOT_SHARED = object()


def _read_shared(ref: ObjectRef[Any]) -> Any:
    """The value mapped from its owner's shared memory when both are on one machine (its
    CPU tensors are not copied); `_NOT_SHARED` otherwise, or where that fails."""
    owner = _torch.rref_owner(ref._rref)
    if isinstance(owner, int):
        return _NOT_SHARED
    here = _runtime.part(Fetched).host()
    try:
        fut = _torch.send_python(
            owner, _shared_form, (*ref._key, here), {}, _torch.default_timeout(), False
        )
        payload = fut.wait()
        return _NOT_SHARED if payload is None else _torch.loads_shared(payload)
    except Exception:  # another machine's memory, or no manager: fetched by RPC
        return _NOT_SHARED


def _shared_form(created_on: int, local_id: int, host: str) -> bytes | None:
    """On the owner: the value with its CPU tensors shared by name, if `host` can map them."""
    if host != _runtime.part(Fetched).host():
        return None
    me = _torch.own_id()
    kept = _torch.owner_view(me, (created_on, local_id), "").local_value()  # its own type
    return _torch.dumps_shared(kept.value)


def _lost(ref: ObjectRef[Any], cause: BaseException) -> ObjectLostError:
    owner = ref.owner
    error = ObjectLostError(
        f"the value of {ref!r} could not be read from its owner {owner!r}: "
        f"{type(cause).__name__}: {cause}; put it again where it is needed",
        str(owner),
    )
    error.__cause__ = cause
    return error


def fetch(ref: ObjectRef[T]) -> Future[T]:
    """A Future of `ref`'s value: done at once on its owner, fetched once elsewhere."""
    if ref._rref.is_owner():
        return completed(ref._rref.local_value().value)
    found = _torch.rref_owner(ref._rref)
    try:  # in a world that heals: its owner died (a value fetched before goes with it)
        _torch.check_received(found if isinstance(found, int) else int(found.id))
    except ObjectLostError as exc:
        return completed(Failure(_lost(ref, exc)))  # type: ignore[arg-type]
    return _runtime.part(Fetched).fetch(ref)


def get(refs: ObjectRef[T] | Sequence[ObjectRef[Any]], timeout: float | None = None) -> Any:
    """The value of `refs` (one ObjectRef), or the values of a list of them, in order.

    On the ref's owner, the value itself; elsewhere, fetched once per process
    while it holds a ref. `timeout` (seconds): TimeoutError past it. A ref
    whose owner died raises ObjectLostError naming it. In a coroutine,
    `await ref` reads it without blocking the event loop.

    Example::

        ref = asyncrpc.put({"step": 3})
        asyncrpc.get(ref)  # {'step': 3}
        asyncrpc.get([ref, asyncrpc.put(4)], timeout=10)  # [{'step': 3}, 4]
    """
    one = isinstance(refs, ObjectRef)
    if isinstance(refs, _torch.FutureType):
        raise TypeError(
            f"get: expected an ObjectRef or a list of them, got a Future {refs!r:.60}; "
            f"read a Future with fut.wait() (or await it), or pass it to a call as it is"
        )
    if not one and not isinstance(refs, (list, tuple)):
        raise TypeError(
            f"get: expected an ObjectRef or a list of them, got {type(refs).__name__} "
            f"{refs!r:.60}; make one with asyncrpc.put(value)"
        )
    items: list[Any] = [refs] if one else list(refs)  # type: ignore[arg-type]
    for item in items:
        if not isinstance(item, ObjectRef):
            raise TypeError(
                f"get: expected an ObjectRef or a list of them, got {type(item).__name__} "
                f"{item!r:.60}; make one with asyncrpc.put(value)"
            )
    fut = gather([fetch(item) for item in items])
    if timeout is not None:
        fut = with_timeout(fut, check_seconds("get", timeout, zero=False))
    values = fut.wait()
    return values[0] if one else values


_RESOLVED = (ObjectRef, Promised)  # top-level arguments that arrive as their values


def has_refs(args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a call's top-level arguments hold an ObjectRef or a Future passed on."""
    return any(isinstance(a, _RESOLVED) for a in args or ()) or any(
        isinstance(v, _RESOLVED) for v in (kwargs or {}).values()
    )


def _value_of(arg: ObjectRef[Any] | Promised) -> Future[Any]:
    return fetch(arg) if isinstance(arg, ObjectRef) else take(arg)


def resolving(
    args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Future[tuple[tuple[Any, ...], dict[str, Any]]]:
    """A Future of (args, kwargs) with each top-level ObjectRef, and each Future passed on
    (`_promised`), replaced by its value.

    Done at once when every value is here; failed (its Failure as the value)
    with the first that could not be read, or whose Future failed.
    """
    args, kwargs = tuple(args), dict(kwargs)
    waits = [(i, _value_of(a)) for i, a in enumerate(args) if isinstance(a, _RESOLVED)]
    waits += [(k, _value_of(v)) for k, v in kwargs.items() if isinstance(v, _RESOLVED)]  # type: ignore[misc]
    out: Future[tuple[tuple[Any, ...], dict[str, Any]]] = new_future()
    left = [len(waits)]
    lock = threading.Lock()

    def settle() -> None:
        values = dict(args=list(args), kwargs=kwargs)
        for where, fut in waits:
            value = outcome(fut)
            if isinstance(value, Failure):
                out.set_result(value)  # type: ignore[arg-type]
                return
            target = values["args"] if isinstance(where, int) else values["kwargs"]
            target[where] = value  # type: ignore[index]
        out.set_result((tuple(values["args"]), values["kwargs"]))  # type: ignore[arg-type]

    def one_done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            settle()

    if not waits:
        settle()
    for _, fut in waits:
        _torch.add_callback(fut, one_done)
    return out
