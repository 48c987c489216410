"""What a `Fanout` is given, checked: members, names, threads (errors say what to write)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ("check_members", "check_names", "check_threads")


def check_members(members: object) -> tuple[Callable[..., Any], ...]:
    if isinstance(members, (torch.nn.Module, str)) or not isinstance(members, Sequence):
        raise TypeError(
            f"members must be a list of callables or modules, got {type(members).__name__}; "
            "write Fanout([model_a, model_b])"
        )
    if not members:
        raise ValueError("members is empty; pass at least one callable or module")
    for i, member in enumerate(members):
        if not callable(member):
            raise TypeError(
                f"member {i} is a {type(member).__name__}, not a callable; pass the function "
                "or module itself, not the result of calling it"
            )
        if isinstance(member, torch.nn.Module) and _no_forward(member):
            kind = type(member).__name__
            raise TypeError(
                f"member {i} ({kind}) has no forward, so calling it raises; define "
                f"forward(self, ...) on {kind}, or pass the module that has one"
            )
    return tuple(members)


def _no_forward(member: torch.nn.Module) -> bool:
    # torch.compile's OptimizedModule sets its forward on the instance
    # (looked up statically: a ScriptModule's forward is a descriptor that may raise)
    found = inspect.getattr_static(type(member), "forward", None)
    return found is torch.nn.Module.forward and "forward" not in vars(member)


def check_names(names: object, members: Sequence[Callable[..., Any]]) -> tuple[str, ...]:
    if names is None:
        return tuple(f"member {i} ({type(m).__name__})" for i, m in enumerate(members))
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"names must be a list of strings, one per member, got {names!r:.60}")
    if len(names) != len(members) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"names must give one string per member ({len(members)}), got {list(names)!r:.80}"
        )
    return tuple(names)


def check_threads(threads: object) -> int | None:
    if threads is None:
        return None
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    return threads
