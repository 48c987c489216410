"""The "fork" engine: one TorchScript driver `jit.fork`s every member, then waits for all.

`torch.jit.fork` runs in parallel only inside TorchScript (called from eager
Python it runs serially), so the members are scripted (ScriptModules stay as
they are) and one scripted `ForkDriver` forks them, each on its own input.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._core import _torch
from ._tuner import FanoutPlan

__all__ = ("ForkDriver", "run_forked", "script_driver")


class ForkDriver(torch.nn.Module):
    """Forks every member on its own input from inside TorchScript, then waits."""

    def __init__(self, members: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.members = torch.nn.ModuleList(members)

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        futures = [
            torch.jit.fork(member, inputs[i])  # type: ignore[no-untyped-call]
            for i, member in enumerate(self.members)
        ]
        return [torch.jit.wait(future) for future in futures]  # type: ignore[no-untyped-call]


def script_driver(members: Sequence[Callable[..., Any]], show: bool) -> torch.jit.ScriptModule:
    """The members scripted (ScriptModules as they are) inside one scripted `ForkDriver`."""
    modules = []
    for i, member in enumerate(members):
        if not isinstance(member, torch.nn.Module):
            raise TypeError(
                f"engine='fork' runs nn.Modules, member {i} is a {type(member).__name__}; "
                "wrap it in a Module or use engine='threads'"
            )
        modules.append(member)
    with _torch.quiet_torchscript(show):
        try:
            script = torch.jit.script
            scripted = [m if isinstance(m, torch.jit.ScriptModule) else script(m) for m in modules]
            return torch.jit.script(ForkDriver(scripted))
        except Exception as error:
            raise TypeError(
                f"engine='fork' needs TorchScript-compatible members taking one Tensor and "
                f"returning one; scripting failed: {str(error).strip().splitlines()[0]}; "
                "use engine='threads' for eager-only code"
            ) from error


@contextlib.contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_forked(
    driver: torch.jit.ScriptModule,
    lock: threading.Lock,
    plan: FanoutPlan,
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
) -> list[Any]:
    """Every member on its own input through `driver`, with the plan's intra-op threads."""
    inputs = []
    for args, kwargs in calls:
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                "engine='fork' calls each member with one Tensor, got "
                f"{len(args)} positional and {len(kwargs)} keyword argument(s); "
                "use engine='threads' for other signatures"
            )
        inputs.append(args[0])
    with lock, _intra_op_threads(plan.intra_op_threads):
        return list(driver(inputs))
