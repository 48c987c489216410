"""How a `Fanout` calls one member, and how a call's results become a Future.

A member's call is a span in torch's profiler (and so in asyncrpc.trace)
while it records, and its error carries a note naming the member; a member
whose parameters are rows of stacks an optimizer steps (_grads) is called on
those rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.futures import Future

from .._core import _futures, _torch

__all__ = ("call", "on_rows", "settle", "span", "succeeded")


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A span named `name` in torch's profiler (and so in asyncrpc.trace), while it records.

    Even with the profiler off a span costs about 10 us, so none is made then.
    """
    if _torch.profiling():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def call(member: Callable[..., Any], name: str, args: Any, kwargs: Any) -> Any:
    try:
        with span(name):
            return member(*args, **kwargs)
    except Exception as error:
        error.add_note(f"raised by {name}")
        raise


def on_rows(member: Any, rows: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    return torch.func.functional_call(member, rows, args, kwargs)


def succeeded(done: Future[Any]) -> bool:
    try:
        done.value()
    except Exception:
        return False
    return True


def settle(work: Callable[[], list[Any]]) -> Future[list[Any]]:
    try:
        return _futures.completed(work())
    except Exception as error:
        return _futures.failed(error)
