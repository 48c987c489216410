"""torch's failures as asyncrpc reads and writes them: its error texts, its remote exceptions.

torch raises a plain RuntimeError for a timeout, a dead peer, a value it
cannot pickle or a lost object: `failure_kind` tells them apart by their
text (tests/test_torch_boundary.py provokes each one). A remote function's
own exception travels in torch's wire form, `RemoteException`, raised by
torch's callers as torch's own reads do.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from torch.distributed.rpc import internal as _rpc_internal

__all__ = (
    "RemoteException",
    "failure_kind",
    "raise_remote_exception",
    "refused",
    "remote_exception",
)

# Each pattern is matched against the first lines of the RuntimeError that torch
# raises from wait()/to_here(); tests/test_torch_boundary.py provokes each one.
_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # An RRef in the call whose owner died: refused as the callee received it (the
    # callee's ObjectLostError, in torch's text), or owned by a process the callee's
    # agent never knew (it died before the callee joined).
    ("lost", re.compile(r"ObjectLostError: |could not find destination id \d+")),
    # A CUDA tensor to or from a worker with no device map for it (TensorPipe's
    # "Request/Response device mapping is not available for destination").
    ("unmapped", re.compile(r"device mapping is not available|only supports CPU tensors")),
    ("timeout", re.compile(r"ran for more than set timeout|timed out", re.IGNORECASE)),
    (
        "unreachable",
        re.compile(
            r"originated at tensorpipe/|Connection (reset|refused|closed)|"
            r"RPCAgent has been shutdown|pipe has been closed|end of file|"
            # a send to a process whose pipe failed already (it died): torch's agent
            # completes the call at once, and its own check of that fails
            r"Future marked complete from outside the thread pool|"
            # a member this agent never knew: it died before this process joined
            r"could not find destination (url for name|name) "
        ),
    ),
    ("unimportable", re.compile(r"No module named|Can't get attribute|can't get attribute")),
    ("unpicklable", re.compile(r"pickl", re.IGNORECASE)),
)


def failure_kind(error: BaseException) -> str | None:
    """Which torch failure `error` stands for (a kind of `_KINDS`: lost, timeout, ...).

    None for anything else (a remote function's own error, say).
    """
    text = str(error)[:2000]
    for kind, pattern in _KINDS:
        if pattern.search(text):
            return kind
    return None


def refused(text: str) -> bool:
    """Whether a traceback's text says TensorPipe's connect was refused (ECONNREFUSED).

    A replacement's join that a member refused: that member's listener is
    closed (see `_listener`), not this process's fault.
    """
    return "ECONNREFUSED: connection refused (this error originated at tensorpipe/" in text


class _Absent:
    """Stands in for a name this torch lacks (`install` names it)."""


RemoteException: type = getattr(_rpc_internal, "RemoteException", _Absent)


def raise_remote_exception(value: Any) -> None:
    """Raise torch's wire form of a remote exception as torch's own reads do."""
    _rpc_internal._handle_exception(value)  # type: ignore[no-untyped-call]


def remote_exception(text: str, cls: type[BaseException]) -> tuple[Any, ...]:
    """The pickle reduction of torch's wire form of a remote exception (for torch callers)."""
    found: Any = sys.modules.get(cls.__module__)
    for name in cls.__qualname__.split("."):
        found = getattr(found, name, None)
    if found is not cls:
        cls = RuntimeError  # a class torch's caller could not import by name
    return (_rpc_internal.RemoteException, (text, cls))
