"""torch's own verbs and Future methods, bound once at import, before any patch.

`install` replaces `Future.wait`, `value` and `add_done_callback` (a read then
names torch's failure and counts as a read for the unread watch), and a
program may swap `rpc.rpc_async` for asyncrpc's. What the boundary calls
itself must stay torch's own: a read through these raises no carried
failure, names nothing, and counts as no read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc

__all__ = (
    "UNSET_TIMEOUT",
    "FutureType",
    "add_callback",
    "future_add_done_callback",
    "future_value",
    "future_wait",
    "outcome",
    "remote",
    "rpc_async",
    "rpc_sync",
)

FutureType = torch._C.Future
UNSET_TIMEOUT: float = rpc.constants.UNSET_RPC_TIMEOUT
# torch's own verbs, bound once: a program may swap rpc.rpc_async for asyncrpc's.
rpc_async = rpc.rpc_async
remote = rpc.remote
rpc_sync = rpc.rpc_sync
# torch's own Future methods, taken before any patch: the unread watch must not
# count what the boundary reads as a read.
future_wait = FutureType.wait
future_value = FutureType.value
future_add_done_callback = FutureType.add_done_callback


def add_callback(fut: Any, callback: Callable[[Any], None]) -> None:
    """torch's own add_done_callback: counts as no read, and keeps no tagged wrapper."""
    future_add_done_callback(fut, callback)


def outcome(fut: Any) -> tuple[bool, Any]:
    """A done Future's outcome as torch holds it: (True, value) or (False, torch's error).

    No read hook runs: a carried failure stays a value, torch's error is not named.
    """
    try:
        return True, future_value(fut)
    except RuntimeError as error:
        return False, error.with_traceback(None)
