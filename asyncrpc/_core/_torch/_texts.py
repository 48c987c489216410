"""torch's failures as asyncrpc reads and writes them: its error texts, its remote exceptions.

Also the warning TensorPipe logs for a failed pipe (`pipe_warning`) and
the report of RRefs not deleted at a worker's end (`rref_leak`), which the
supervisor of a world that heals or grows drops for the departures it
expects (`_launch/_quiet`).

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
    "pipe_warning",
    "raise_remote_exception",
    "refused",
    "remote_exception",
    "rref_leak",
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
    # The callee could not unpickle the request (an argument's class it cannot import,
    # a __setstate__ that raised): the callee's error ("Error on Node N") names torch's
    # deserialize frame. The call never ran there. (A reply this side cannot unpickle
    # names that frame too, without the node: unimportable or unpicklable, below.)
    (
        "unreadable",
        re.compile(
            r"\AError on Node \d+: .*torch/distributed/rpc/internal\.py\(\d+\): deserialize", re.S
        ),
    ),
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


# The warning torch's TensorPipe agent logs (c10's logging, on stderr) when a pipe to
# a peer fails: a read of a request or a response, or a send, to or from a process
# that died, left, or is leaving. `agent` and `peer` are torch's names of the two
# processes (a replacement's or an added member's: "name:<torch id>").
_PIPE_WARNING = re.compile(
    r"^\[W[^\]]*tensorpipe_agent\.cpp:\d+\] RPC agent for (?P<agent>\S+) encountered error "
    r"when (?:reading incoming (?:request|response) from|sending outgoing request #\d+ to|"
    r"sending response to request #\d+ to) (?P<peer>\S+): "
)


def pipe_warning(line: str) -> tuple[str, str] | None:
    """(agent, peer): the torch names in TensorPipe's warning of a failed pipe, else None.

    A line such as ``[W1129 09:42:23.409 tensorpipe_agent.cpp:723] RPC agent for
    worker0 encountered error when reading incoming request from worker2:2: EOF:
    end of file (...)``.
    """
    found = _PIPE_WARNING.match(line)
    return (found["agent"], found["peer"]) if found is not None else None


# torch's report, as a worker's agent stops, of the RRefs it did not delete: a header
# line, then one line per RRef. A world that healed or changed members deletes none
# at its end (see `_healing.leave`), so it reports every RRef held then.
_RREF_LEAK = re.compile(
    r"^(?:\[W[^\]]*rref_context\.cpp:\d+\] Detected RRef Leaks during shutdown|"
    r"Leaking RRef GloballyUniqueId\()"
)


def rref_leak(line: str) -> bool:
    """Whether `line` is part of torch's report of RRefs not deleted at a worker's end."""
    return _RREF_LEAK.match(line) is not None


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
