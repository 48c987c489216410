"""Asking the workers of a world through its side channel: no RPC thread is needed.

A request goes into the worker's queue in the world's store, where its
watcher thread (`_watcher`) takes it at once, however busy its RPC threads
are, and answers into a key of the asker's choosing::

    asker (a worker, asyncrpc-dump)       store (the world's, side prefix)      worker r
      add queue/r/n; set queue/r/{n} ─────> "ask dump reply/<token>/r" ──wakes──> watcher
      poll reply/<token>/r <───────────────────────────── set reply/<token>/r = {JSON}

An asker from outside the world (the commands) connects to the store by the
address in the world's registration (`_registry`).
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterable
from typing import Any

from . import _polling, _watcher
from ._torch import PrefixStore, Store, TCPStore

__all__ = ["ask", "connect"]


def connect(address: str, prefix: str, timeout: float = 5.0) -> Store:
    """The side channel of the world whose store listens at `address` (`host:port`)."""
    host, _, port = address.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return PrefixStore(prefix, store)


def ask(
    store: Store, ranks: Iterable[int], kind: str, timeout: float = 4.0
) -> dict[int, dict[str, Any] | None]:
    """Ask every rank for `kind` ("dump", "top"); rank -> its answer, None if none came."""
    token = uuid.uuid4().hex
    keys = {rank: f"reply/{token}/{rank}" for rank in ranks}
    for rank, key in keys.items():
        _watcher.send_request(store, rank, f"ask {kind} {key}")
    answers: dict[int, dict[str, Any] | None] = dict.fromkeys(keys)
    waiting = dict(keys)

    def answered() -> bool:
        for rank, key in list(waiting.items()):
            if store.check([key]):
                answers[rank] = json.loads(store.get(key))
                store.delete_key(key)
                del waiting[rank]
        return not waiting

    _polling.within(answered, timeout)  # those that did not answer in time: None
    return answers
