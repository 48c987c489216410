"""The side channel: a queue per worker in the world's store, and the thread that reads it.

What must reach a worker whose RPC threads may all be busy goes through the
store the world was formed with, not through RPC: a cancel (`_cancel`), a
question from `asyncrpc-dump` or a peer (`_side`: "ask"), the news of a world
that heals ("member"). Each worker's watcher thread blocks on its own queue
and hands each text to its taker::

    sender (any process)             world's store                 worker {rank}
    send_request(store, rank, text)
      add  queue/{rank}/n        ──>  n
      set  queue/{rank}/{n}      ──>  text ── wakes ──> watcher thread (_watch)
                                                          "{key}"    -> _cancel.deliver
                                                          "ask ..."  -> answer(kind), set
                                                                        into the reply key
                                                          "member .."-> member(text)
                                                          "stop"     -> it ends

The watcher makes its own store connection (it blocks in `wait`), and a
non-daemon exit guard stops it before the interpreter finalizes: a thread
still inside torch's store client then aborts the process.
"""

from __future__ import annotations

import datetime
import itertools
import json
import threading
from collections.abc import Callable
from typing import Any

from . import _cancel, _runtime, _torch

__all__ = (
    "SIDE_PREFIX",
    "Watcher",
    "request",
    "send_request",
    "side_channel",
    "watch",
    "watching",
)

SIDE_PREFIX = "asyncrpc/side/"  # a world torch started; asyncrpc's own add its attempt
_JOIN_S = 3.0  # how long a stopping watcher may take
_GUARD_POLL_S = 0.2  # how often the exit guard looks whether the main thread has ended
_STOP = "stop"

Answer = Callable[[str], str]  # a request's kind -> the answer (JSON text)


class Watcher:
    """This world's watcher of its side channel (a part of `_runtime`); `close` stops it."""

    def __init__(self) -> None:
        self.started = False
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.guard: threading.Thread | None = None
        self.done = threading.Event()  # ends the guard
        self.connected = threading.Event()  # the watcher has its own connection (`_watch`)
        self.exits_at_once = False  # this process ends with os._exit (an embedded worker)
        self.rank = -1
        self.store: Any = None  # the side channel: requests go there, a stop wakes it
        self.address: str | None = None  # where the store listens, if it is a TCPStore
        self.prefix = SIDE_PREFIX
        self.answer: Answer | None = None
        self.member: Callable[[str], None] | None = None  # "member ..." texts (_membership)

    def close(self) -> None:
        _stop(self)


# ---- senders ---------------------------------------------------------------------------


def request(sent: _cancel.Sent) -> bool:
    """Ask `sent.callee` to stop the call `sent.key`; False when the store cannot be reached."""
    store = _runtime.part(Watcher).store
    if store is None:
        return False
    try:
        send_request(store, sent.callee, str(sent.key))
    except Exception:  # the world is going away: nothing is left to stop
        return False
    return True


def send_request(store: Any, rank: int, text: str) -> None:
    """Queue `text` for worker `rank`'s watcher in the side channel `store`."""
    number = store.add(f"queue/{rank}/n", 1)
    store.set(f"queue/{rank}/{number}", text)


# ---- the watcher: what is addressed to this worker, taken from the store ----------------


def watch(
    prefix: str = SIDE_PREFIX,
    answer: Answer | None = None,
    agent_gone: Callable[[], bool] | None = None,
    member: Callable[[str], None] | None = None,
    exits_at_once: bool = False,
) -> None:
    """Start this worker's watcher of its side channel (once per world).

    The channel is `prefix` in the root store of torch's agent (the world's
    store). `answer(kind)` answers requests other than cancels ("ask" from
    `_side`); without it they get no answer. `agent_gone()` is called once
    torch's agent has stopped without asyncrpc (torch's own `rpc.shutdown()`):
    it ends what the world set up, or returns False when someone else does.
    `member(text)` takes the news of a world that heals ("member gone ...").
    `exits_at_once`: this process ends with `os._exit` (an embedded worker),
    so the world's end need not wait for a watcher still connecting.
    """
    watcher = _runtime.part(Watcher)
    with watcher.lock:
        if answer is not None:
            watcher.answer = answer
        if member is not None:
            watcher.member = member
        if watcher.started or not _torch.agent_running():
            return
        watcher.started = True  # also when it cannot start: calls must not retry each time
        try:
            root = _torch.root_store(_torch.agent_store())
            store = _torch.PrefixStore(prefix, root)
            rank = int(_torch.current_agent().get_worker_info().id)
        except Exception:  # an agent without a store: cancels cannot reach this worker
            return
        thread = threading.Thread(
            target=_watch, args=(watcher, root, prefix, rank), name="asyncrpc-cancels", daemon=True
        )
        # A thread still inside torch's store when the interpreter finalizes aborts the
        # process, so the watcher must stop first, also when the program never calls
        # shutdown. The guard is no daemon: the interpreter waits for it before atexit
        # and finalization, and it stops the watcher once the main thread has ended.
        # (An atexit hook would stay registered, and leave a slot behind per world.)
        done = threading.Event()
        guard = threading.Thread(
            target=_guard,
            args=(watcher, done, agent_gone),
            name="asyncrpc-exit-guard",
            daemon=False,
        )
        watcher.connected.clear()
        watcher.exits_at_once = exits_at_once
        watcher.thread, watcher.rank, watcher.store = thread, rank, store
        watcher.guard, watcher.done = guard, done
        watcher.address, watcher.prefix = _torch.store_address(root), prefix
        thread.start()
        guard.start()


def watching() -> bool:
    """True once this worker's watcher has been started (or could not be)."""
    return _runtime.part(Watcher).started


def side_channel() -> tuple[Any, str | None, str] | None:
    """(store, address, prefix) of this worker's side channel while it watches, else None."""
    watcher = _runtime.part(Watcher)
    with watcher.lock:
        if watcher.store is None:
            return None
        return watcher.store, watcher.address, watcher.prefix


def _guard(watcher: Watcher, done: threading.Event, agent_gone: Callable[[], bool] | None) -> None:
    main = threading.main_thread()
    while not done.wait(_GUARD_POLL_S):
        # torch's own shutdown first: a program that exits right after it still has the
        # world ended (its registration removed), as if it had lived one poll longer.
        if agent_gone is not None and not _torch.agent_running() and agent_gone():
            return  # torch's own shutdown ended the world; agent_gone stopped the watcher
        if not main.is_alive():  # the interpreter is exiting: it waits for this thread
            _stop(watcher)
            return


def _stop(watcher: Watcher) -> None:
    with watcher.lock:
        thread, rank, store = watcher.thread, watcher.rank, watcher.store
        guard, done = watcher.guard, watcher.done
        watcher.started, watcher.thread, watcher.store, watcher.guard = (
            False, None, None, None,
        )  # fmt: skip
        watcher.answer, watcher.address, watcher.member = None, None, None
    done.set()
    if guard is not None and guard is not threading.current_thread():
        guard.join(_JOIN_S)
    if thread is None:
        return
    try:
        send_request(store, rank, _STOP)
    except Exception:
        pass  # the store is gone: the watcher's wait fails at once, and it ends
    # Joined also while it still makes its connection (a dropped name lookup: 5-10 s):
    # a thread inside torch's store client when the interpreter finalizes aborts the
    # process. Not in a process that ends with os._exit: nothing finalizes there.
    if watcher.connected.is_set() or not watcher.exits_at_once:
        thread.join(_JOIN_S)


def _watch(watcher: Watcher, root: Any, prefix: str, rank: int) -> None:
    # Its own connection, for it blocks in wait(); made here, not in the start: each
    # connection is a name lookup in c10d, and a resolver that drops a burst of them
    # (every worker of a large world at once) stalls this thread 5 s, not the start.
    try:
        store = _torch.PrefixStore(prefix, root.clone())
    except Exception:  # the store went away with the world
        return
    watcher.connected.set()
    forever = datetime.timedelta(days=365)
    for number in itertools.count(1):
        key = f"queue/{rank}/{number}"
        try:
            store.wait([key], forever)
            text = store.get(key).decode()
            store.delete_key(key)
        except Exception:  # the store went away with the world
            return
        if text == _STOP:
            return
        try:
            _take(watcher, store, text)
        except Exception:  # a request must never end the watcher
            continue


def _take(watcher: Watcher, store: Any, text: str) -> None:
    if text.startswith("ask "):
        _answer(watcher, store, text)
    elif text.startswith("member "):
        member = watcher.member
        if member is not None:
            member(text)
    else:
        _cancel.deliver(int(text))


def _answer(watcher: Watcher, store: Any, text: str) -> None:
    """`ask <kind> <reply key>`: answer into the reply key (an error's text if it fails)."""
    _, kind, reply = text.split(" ", 2)
    answer = watcher.answer
    try:
        payload = answer(kind) if answer is not None else '{"error": "not answering yet"}'
    except Exception as exc:
        payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    store.set(reply, payload)
