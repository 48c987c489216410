"""Streams: a remote generator's items as they are made, with backpressure.

    caller                                         callee
    s = stream("w1", gen, args=(...), window=32)
      pull(key, gen and its args, n=32) ──────────> gen(*args) starts and runs ahead
                                                    while it has credit (n items); the
                                                    pull takes the items made so far, or
      <──── [items], ended?, failure ───────────── waits for the first; it pauses at its
                                                    `yield` when the credit is spent
    for x in s: ...  (from the buffer)
      pull(key, n = window - buffered) ───────────> resumes it where it paused
    break, s.close() or s dropped
      close(key) ─────────────────────────────────> gen.close() / aclose(): its `finally` runs

At most `window` items are buffered or asked for at any time, and the
generator runs only while a pull is open, so a fast producer cannot fill the
consumer's memory. Every pull is a call through the one call path: checked,
traced, cancellable, its failures named as every call's are. A generator
that raises ends the stream with its error after the items before it. Each
item is captured at its `yield`, before the generator resumes (pickled, its
tensors copied: _stream_items), so it arrives as it was there.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

from torch.futures import Future

from . import _activity, _calls, _cancel, _runtime, _stream_items, _torch, _world
from ._errors import CancelledError, SerializationError
from ._execution import start_coroutine
from ._failures import Failure, capture, check_reply, hold, label_of
from ._futures import completed, new_future
from ._objects import has_refs, resolving
from ._promised import release, release_after

__all__ = (
    "DEFAULT_WINDOW",
    "Producers",
    "Stream",
    "check_window",
    "open_producers",
    "resolving_first",
    "stream",
)

T = TypeVar("T")
DEFAULT_WINDOW = 32


def stream(
    to: _calls.Target,
    func: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    window: int = DEFAULT_WINDOW,
    timeout: float = _calls.UNSET_RPC_TIMEOUT,
) -> Stream[Any]:
    """Run generator `func(*args, **kwargs)` on worker `to`; iterate its items as they come.

    `func` is a generator function (`def` with `yield`) or an async
    generator (`async def` with `yield`). The result works with `for` and
    `async for`, in the order produced. At most `window` items are in flight
    (produced and not yet consumed); `timeout` bounds the wait for each
    batch of items. Breaking out of the loop, `close()`, or dropping the
    stream closes the remote generator (its `finally` runs). A generator that
    raises ends the stream with that error, typed as every remote failure;
    a dead producer ends it with `WorkerUnreachableError`.

    Example::

        for step, logits in enumerate(asyncrpc.stream("worker1", generate, args=(prompt,))):
            print(step, logits.argmax())
    """
    window = check_window(window)
    call = _calls.check("stream", to, func, args, kwargs, timeout)
    return Stream(call, window)


def check_window(window: object) -> int:
    """A stream window: a positive int, or a ValueError saying what was wrong."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive int (items in flight), got {window!r}")
    return window


class Stream(Generic[T]):
    """The caller's end of a remote generator: an iterator (sync and async) of its items.

    Made by `asyncrpc.stream(...)` or a handle's `stream(...)`. Close it with
    `close()` or a `with` block when leaving it before its end.
    """

    def __init__(self, call: _calls.Call, window: int) -> None:
        self._call = call
        self._window = window
        self._buffer: collections.deque[Any] = collections.deque()
        self._pending: Future[Any] | None = None
        self._ended = False
        self._closed = False  # by close(): a cancelled pull then reads as the end
        self._read = 0  # items received so far
        self._failure: Failure | None = None
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_remote, call)
        self._pull(opening=True)

    def __iter__(self) -> Iterator[T]:
        """The items, for a `for` loop: leaving the loop early (`break`, an error) closes it.

        The loop's iterator is a generator that closes the stream when it is
        closed or dropped, which CPython does as the loop ends.
        """
        try:
            while True:
                try:
                    item = self.__next__()
                except StopIteration:
                    return
                yield item
        finally:
            self.close()

    def __next__(self) -> T:
        while True:
            item = self._take(StopIteration)
            if item is not _NOTHING:
                return item  # type: ignore[no-any-return]
            pending = self._pending
            assert pending is not None
            try:
                with _calls.holding_rpc_thread(self._call.worker, self._call.label):
                    reply = pending.wait()
            except BaseException as error:
                if self._closed_here(error):
                    raise StopIteration from None
                self._abandon()
                raise
            self._receive(pending, reply)

    async def __aiter__(self) -> AsyncIterator[T]:
        """The items, for `async for`: leaving the loop early closes the stream."""
        try:
            while True:
                try:
                    item = await self.__anext__()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            self.close()

    async def __anext__(self) -> T:
        while True:
            item = self._take(StopAsyncIteration)
            if item is not _NOTHING:
                return item  # type: ignore[no-any-return]
            pending = self._pending
            assert pending is not None
            try:
                reply = await cast(Awaitable[Any], pending)  # asyncrpc's __await__
            except BaseException as error:
                if self._closed_here(error):
                    raise StopAsyncIteration from None
                self._abandon()
                raise
            self._receive(pending, reply)

    def close(self) -> None:
        """Close the remote generator (its `finally` runs) and stop pulling.

        A consumer waiting for items in another thread wakes and sees the end.
        """
        with self._lock:
            ended, self._ended = self._ended, True
            self._closed = True
            self._buffer.clear()
            pending = self._pending
        if not ended:
            self._finalizer()  # first: a reader woken below closes too, and finds it done
        if pending is not None:
            _torch.cancel(pending)  # a reader blocked on it wakes (CancelledError)

    def _closed_here(self, error: BaseException) -> bool:
        """True when `error` is the wake-up of a pull that `close()` cancelled."""
        return self._closed and isinstance(error, CancelledError)

    def _abandon(self) -> None:
        """A pull failed (a timeout, a dead producer): end here, and close the generator."""
        with self._lock:
            self._ended, self._pending = True, None
            self._buffer.clear()
        self._finalizer()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "ended" if self._ended and not self._buffer else f"{len(self._buffer)} buffered"
        return f"<Stream of {label_of(self._call.label)} on {self._call.worker!r}, {state}>"

    def _take(self, stop: type[Exception]) -> Any:
        """The next buffered item, or _NOTHING; raises `stop` at the end of the stream."""
        with self._lock:
            if self._buffer:
                item = self._buffer.popleft()
                self._pull_if_room()
                return item
            if self._ended:
                failure, self._failure = self._failure, None
                if failure is not None:
                    check_reply(failure)
                raise stop
            return _NOTHING

    def _receive(self, pending: Future[Any], reply: Any) -> None:
        packed, ended, failure = reply
        items, unreadable = self._unpack(packed)
        if unreadable is not None:
            ended, failure = True, unreadable
            self._finalizer()  # the producer still runs: close its generator
        with self._lock:
            if pending is not self._pending:
                return  # another reader took it
            self._pending = None
            self._buffer.extend(items)
            if ended:
                self._ended, self._failure = True, failure
                self._finalizer.detach()  # the producer ended: nothing to close
            else:
                self._pull_if_room()

    def _unpack(self, packed: list[Any]) -> tuple[list[Any], Failure | None]:
        """The items, unpickled one by one: the first this worker cannot read ends them."""
        items = []
        for item in packed:
            try:
                items.append(_stream_items.unpack(item))
            except Exception as exc:
                self._read += len(items)
                error = SerializationError(
                    f"{label_of(self._call.label)} on {self._call.worker!r} yielded an item "
                    f"this worker cannot unpickle (item {self._read + 1}: "
                    f"{type(exc).__name__}: {exc}); make its class importable here too; the "
                    f"items before it were delivered, and the stream ends here"
                )
                return items, hold(error)
        self._read += len(items)
        return items, None

    def _pull_if_room(self) -> None:
        if self._pending is None and not self._ended and len(self._buffer) < self._window:
            self._pull(opening=False)

    def _pull(self, opening: bool) -> None:
        call = self._call
        made = (call.func, tuple(call.args or ()), dict(call.kwargs or {}), label_of(call.label))
        args = (call.sent.key, made if opening else None, self._window - len(self._buffer))
        pull_call = _calls.check(
            "stream", call.worker, _pull, args, None, call.seconds, call.label,
            continuing=not opening,
        )  # fmt: skip
        try:
            self._pending = _calls.send(pull_call)
        except BaseException:
            self._ended = True
            self._finalizer.detach()
            if opening:
                release(call.lent)
            raise
        if opening and call.lent:  # Futures passed: read by the producer before its first reply
            release_after(self._pending, call.lent)


class _Nothing:
    pass


_NOTHING = _Nothing()


def _close_remote(call: _calls.Call) -> None:
    """Tell the producer to close its generator (fire and forget)."""
    try:
        close = _calls.check("stream", call.worker, _close, (call.sent.key,), None, -1, call.label,
                             continuing=True)  # fmt: skip
        _calls.send(close)
    except Exception:  # the world or the producer is gone: nothing is left to close
        pass


# ---- the producer's side ---------------------------------------------------------------


class _Producer:
    """One open generator on the callee and its pump, which runs only on credit.

    Each pull grants credit: how many items the consumer can take now. The
    pump (a thread for a generator, a Task for an async generator) makes
    items while it has credit and pauses at the generator's `yield`
    otherwise; a pull takes what is ready, or waits for the first item.
    """

    def __init__(self, gen: Any, label: object) -> None:
        self.gen = gen
        self.label = label
        self.items: collections.deque[Any] = collections.deque()
        self.allowed = 0  # items it may hold for the consumer
        self.ended = False
        self.failure: Failure | None = None
        self.closing = False
        self.waiting: Future[Any] | None = None  # a pull with nothing to take yet
        self.cond = threading.Condition()
        self.credit: Future[Any] | None = None  # an async pump waits on it
        self.pump: Future[Any] | None = None  # an async pump's Task
        self.next_item: Future[Any] | None = None  # the item an async pump awaits
        self.thread: threading.Thread | None = None  # a generator's pump
        self.made = 0  # items made so far
        self.unsendable = False  # it yielded an item that cannot be pickled

    def pull(self, n: int) -> Future[Any]:
        with self.cond:
            self.allowed = n
            self.cond.notify()
            credit, self.credit = self.credit, None
            if self.items or self.ended:
                reply = completed(self._take())
            else:
                reply = self.waiting = new_future()
        if credit is not None:
            credit.set_result(None)
        return reply

    def put(self, item: Any) -> None:
        """The pump made `item`."""
        with self.cond:
            self.items.append(item)
            waiting, self.waiting = self.waiting, None
            reply = self._take() if waiting is not None else None
        if waiting is not None:
            waiting.set_result(reply)

    def finish(self, failure: Failure | None) -> None:
        """The generator ended (or raised)."""
        with self.cond:
            self.ended, self.failure = True, failure
            waiting, self.waiting = self.waiting, None
            reply = self._take() if waiting is not None else None
        if waiting is not None:
            waiting.set_result(reply)

    def has_credit(self) -> bool:
        return self.allowed > len(self.items)

    def _take(self) -> tuple[list[Any], bool, Failure | None]:
        items = list(self.items)
        self.items.clear()
        self.allowed -= len(items)
        return items, self.ended, self.failure if self.ended else None


_CLOSE_S = 2.0  # how long the world's end waits for a generator's finally


class Producers:
    """The generators this worker runs for others' streams (a part of `_runtime`).

    `close` closes the ones nobody closed (their consumers died) as the world ends.
    """

    def __init__(self) -> None:
        self.open: dict[int, _Producer] = {}
        self.lock = threading.Lock()
        # Streams closed before their first pull arrived (bounded: the oldest go first).
        self.closed_early: collections.OrderedDict[int, bool] = collections.OrderedDict()

    def close(self) -> None:
        _close_all(self)

    def counted(self) -> None:
        """Tell `_activity` how many are open (under `lock`)."""
        _runtime.part(_activity.Activity).streams = len(self.open)


_CLOSED_EARLY_KEPT = 4096


def _pull(key: int, opener: tuple[Any, ...] | None, n: int) -> Future[Any]:
    """One pull: the items ready (up to `n`, the credit), whether it ended, its failure."""
    producers = _runtime.part(Producers)
    producer = producers.open.get(key)
    if producer is None:
        with producers.lock:
            closed_first = producers.closed_early.pop(key, None) is not None
        if opener is None or closed_first:
            return completed(([], True, None))  # closed meanwhile: an ended stream
        opened = _open(key, *opener)
        if isinstance(opened, Failure):
            return completed(([], True, opened))
        producer = opened
    state = _cancel.current()
    if state is not None and producer.thread is not None:
        state.worker = producer.thread.ident  # where asyncrpc-dump finds its stack
    reply = producer.pull(n)
    reply.add_done_callback(lambda done: _forget_if_ended(key, producer, done))
    return reply


_torch.mark_async(_pull, _pull)


def resolving_first(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A generator over ObjectRef arguments (and Futures passed on): it reads their values
    first, where it runs (its own thread, or the event loop for an async generator), then
    yields func's items."""
    if inspect.isasyncgenfunction(func):

        async def pumped() -> AsyncIterator[Any]:
            values, named = await cast(Awaitable[Any], resolving(args, kwargs))
            async for item in func(*values, **named):
                yield item

        return pumped()

    def pulled() -> Iterator[Any]:
        values, named = resolving(args, kwargs).wait()
        yield from func(*values, **named)

    return pulled()


def _open(
    key: int, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], label: str
) -> _Producer | Failure:
    """Start the generator of a stream; `label` names it as the caller wrote it."""
    try:
        gen = (
            resolving_first(func, args, kwargs)
            if has_refs(args, kwargs)
            else func(*args, **kwargs)
        )
        if not (inspect.isgenerator(gen) or inspect.isasyncgen(gen)):
            raise TypeError(
                f"asyncrpc.stream runs a generator function (def or async def with `yield`), "
                f"but {label} returned {type(gen).__name__}; yield the items, or call "
                f"it with rpc_sync"
            )
    except Exception as exc:
        return capture(exc, _world.describe_self(), label)
    producer = _Producer(gen, label)
    producers = _runtime.part(Producers)
    with producers.lock:
        producers.open[key] = producer
        producers.counted()
    world = _world.running()
    if world is not None and world.members is not None:  # a world that heals
        world.members.on_gone(_close_from)
        world.members.on_busy(open_producers)  # a removed worker leaves once they are done
    if inspect.isasyncgen(gen):
        producer.pump = start_coroutine(_pump_async(producer), func, reply=False)
    else:
        name = f"asyncrpc-stream-{label}"
        producer.thread = threading.Thread(target=_pump, args=(producer,), name=name, daemon=True)
        producer.thread.start()
    return producer


def _pump(producer: _Producer) -> None:
    """Run a generator on credit, on a thread of its own; close it when told."""
    failure = None
    try:
        while True:
            with producer.cond:
                while not producer.has_credit() and not producer.closing:
                    producer.cond.wait()
                if producer.closing:
                    break
            try:
                item = next(producer.gen)
            except StopIteration:
                break
            producer.put(_sendable(item, producer))
    except Exception as exc:
        failure = capture(exc, _world.describe_self(), producer.label)
    finally:
        if producer.closing or (isinstance(failure, Failure) and producer.unsendable):
            producer.gen.close()  # paused at its yield: GeneratorExit runs its finally
        producer.finish(failure)


async def _pump_async(producer: _Producer) -> None:
    """Run an async generator on credit; cancelled (closed), it stops at its await."""
    failure = None
    try:
        while not producer.closing:
            if not producer.has_credit():
                with producer.cond:
                    credit = producer.credit = new_future()
                await cast(Awaitable[Any], credit)  # asyncrpc's __await__
                continue
            producer.next_item = start_coroutine(_anext(producer.gen), producer.label, reply=False)
            producer.put(_sendable(await cast(Awaitable[Any], producer.next_item), producer))
    except StopAsyncIteration:
        pass
    except asyncio.CancelledError:  # closed: if it waited for credit, close it at its yield
        await producer.gen.aclose()
    except Exception as exc:
        failure = capture(exc, _world.describe_self(), producer.label)
        if producer.unsendable:
            await producer.gen.aclose()
    producer.finish(failure)


def _sendable(item: Any, producer: _Producer) -> Any:
    """`item` as it is at its `yield`, captured before the generator resumes (its tensors
    copied), and known to pickle: items travel together, and one that cannot would fail
    the whole message, the items before it too."""
    try:
        packed = _stream_items.pack(item)
    except Exception as exc:
        producer.unsendable = True
        raise SerializationError(
            f"{producer.label} yielded an item that cannot be sent (item {producer.made + 1}, "
            f"a {type(item).__name__}: {type(exc).__name__}: {exc}); the items before it "
            f"were delivered, and the stream ends here"
        ) from exc
    producer.made += 1
    return packed


async def _anext(gen: Any) -> Any:
    return await gen.__anext__()


def _close(key: int) -> None:
    """Close a producer the consumer left: its generator's `finally` runs.

    A close may overtake the pull that opens the stream (two calls, two RPC
    threads): its key is then kept, and that pull opens nothing.
    """
    producers = _runtime.part(Producers)
    with producers.lock:
        producer = producers.open.pop(key, None)
        producers.counted()
        if producer is None:
            producers.closed_early[key] = True
            while len(producers.closed_early) > _CLOSED_EARLY_KEPT:
                producers.closed_early.popitem(last=False)
    if producer is None:
        return
    with producer.cond:
        producer.closing = True
        producer.cond.notify()  # a paused pump thread wakes, and closes its generator
    if inspect.isasyncgen(producer.gen):
        # Making an item: stop it at its await (its finally runs); paused at its
        # yield: stop the pump, which closes the generator there.
        making = producer.next_item
        target = making if making is not None and not making.done() else producer.pump
        if target is not None:
            _torch.cancel(target)


def _close_all(producers: Producers) -> None:
    """Close the generators of streams nobody closed (their consumers died), as the world ends."""
    threads = [p.thread for p in list(producers.open.values()) if p.thread is not None]
    for key in list(producers.open):
        _close(key)
    with producers.lock:
        producers.closed_early.clear()
    for thread in threads:  # the process may exit next: let their finally blocks run
        thread.join(_CLOSE_S)


def _close_from(torch_id: int) -> None:
    """A consumer's process died (a world that heals): close the streams it left open."""
    for key in list(_runtime.part(Producers).open):
        if key >> _cancel.KEY_BITS == torch_id:
            _close(key)


def _forget_if_ended(key: int, producer: _Producer, reply: Future[Any]) -> None:
    if reply.value()[1]:  # the reply that told the consumer it ended
        producers = _runtime.part(Producers)
        with producers.lock:
            if producers.open.get(key) is producer:
                del producers.open[key]
                producers.counted()


def open_producers() -> int:
    """How many generators this worker holds open for streams (for tests and checks)."""
    return len(_runtime.part(Producers).open)
