"""Stacked gradients: one optimizer over the stacks steps every member at once.

`Fanout.parameters()` hands out the stacks the members' parameters are rows
of (_storage), made leaves that need gradients. From then on::

    a stacked call ─── reads the stacks themselves: backward hands each stack
                       its gradient in one piece (stack.grad), no per-member split
    each member's .grad ── a view of its row of stack.grad, pointed before every
                       call and after every backward (`point`), so a call run
                       member by member, a member's own backward, and per-member
                       clipping or logging read and write that same memory
    optimizer.step() ─ steps the stacks in place: every member's tensors are rows
    zero_grad() ────── of the optimizer over the stacks: the members' views are
                       dropped with stack.grad at the next call

A member's `.grad` found unlike its view is folded in: None where its row was
pointed before (zeroed member by member: the row is zeroed), another tensor
(an out-of-place accumulation, or a backward of the member alone) is copied
into the row where the row was pointed before, added where the row is new.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._core import _torch

__all__ = ("StackedGrads",)

_logger = logging.getLogger("asyncrpc")


class StackedGrads:
    """The stacks of one Storage as leaves that need gradients, and the members' views."""

    def __init__(
        self, stacks: dict[str, torch.Tensor], group_of: Callable[[str], Sequence[torch.Tensor]]
    ) -> None:
        self.stacks = stacks  # name -> the stack handed out (its identity is the optimizer's)
        self._group_of = group_of
        self._pointed: dict[str, torch.Tensor | None] = dict.fromkeys(stacks)
        self._seen: dict[str, list[int]] = {}  # the members' .grad pointers when last pointed
        self._lock = threading.Lock()
        for name, stack in stacks.items():
            self.replace(name, stack)

    def replace(self, name: str, stack: torch.Tensor) -> None:
        """`stack` is the members' `name` now (restacked: another shape or dtype); the
        members' gradients (`.double()` converts them) become its `.grad`."""
        self.stacks[name] = stack
        self._pointed[name] = None
        stack.requires_grad_(True)
        stack.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda done: self._point_one(name, create=False, after_backward=True)
        )
        self._adopt(name)

    def adopt(self) -> None:
        """The members' gradients now become their rows of stack.grad (zeros where None)."""
        for name in self.stacks:
            self._adopt(name)

    def _adopt(self, name: str) -> None:
        with self._lock, torch.no_grad():
            stack, members = self.stacks[name], self._group_of(name)
            if all(p.grad is None for p in members):
                return
            grad = stack.grad = torch.zeros_like(stack)
            for row, param in zip(grad.unbind(0), members, strict=True):
                if param.grad is not None:
                    row.copy_(param.grad)
                if param.requires_grad:
                    param.grad = row
            self._pointed[name] = grad
            self._seen[name] = list(map(_grad_pointer, members))

    def current(self) -> bool:
        """True when every member's tensor matches its stack's row (shape, dtype, device)."""
        return all(_alike(stack, self._group_of(name)) for name, stack in self.stacks.items())

    def needs(self, name: str) -> list[bool]:
        """Which members' tensor of `name` takes gradients (a frozen one's row takes none)."""
        return [p.requires_grad for p in self._group_of(name)]

    def rows(self, members: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
        """Each member's parameters as rows of the stacks, for a call member by member.

        `torch.func.functional_call(member, rows[i], ...)` runs the member's own
        forward (its hooks too) on these rows, whose gradients reach stack.grad
        in one piece when backward runs, whenever the optimizer zeroed it. A
        tensor hook on a member's parameter could not run (the rows take the
        gradient): a RuntimeError says so, rather than a hook silently skipped.
        """
        for i, member in enumerate(members):
            for name, param in member.named_parameters():
                if _torch.tensor_hooks(param):
                    raise RuntimeError(
                        f"member {i}'s {name} has a tensor hook (register_hook or "
                        "register_post_accumulate_grad_hook), which cannot run while "
                        "Fanout.parameters() holds the gradients (they reach the stacks, not "
                        f"{name}); remove the hook, or step the members' own parameters"
                    )
        names = list(self.stacks)
        columns = _RowsOf.apply(*self.stacks.values())  # type: ignore[no-untyped-call]
        count = len(columns) // len(names)
        rows: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
        for k, name in enumerate(names):
            for i, param in enumerate(self._group_of(name)):
                row = columns[k * count + i]
                # A frozen member's own forward gives outputs that need no gradient.
                rows[i][name] = row if param.requires_grad else row.detach()
        return rows

    def point(self, create: bool) -> None:
        """Make each member's `.grad` a view of its row of stack.grad.

        `create`: make stack.grad (zeros) where it is missing, for a call that
        runs member by member (its gradients reach the members' `.grad` only).
        """
        for name in self.stacks:
            self._point_one(name, create)

    def _point_one(self, name: str, create: bool, after_backward: bool = False) -> None:
        stack = self.stacks[name]
        grad = stack.grad
        pointed = grad is not None and self._pointed[name] is grad
        members = self._group_of(name)
        if pointed and list(map(_grad_pointer, members)) == self._seen.get(name):
            return  # as pointed last time: the common case, a few microseconds
        if not _alike(stack, members):
            return  # moved (`.double()`): the storage restacks at its next call (`replace`)
        with self._lock, torch.no_grad():
            if grad is None:
                if not create:
                    self._drop_stale(name, members)
                    return
                grad = stack.grad = torch.zeros_like(stack)
            with torch.enable_grad() if grad.requires_grad else contextlib.nullcontext():
                rows = grad.unbind(0)  # one call for every row; create_graph: with its graph
            for param, row in zip(members, rows, strict=True):
                if not param.requires_grad:
                    continue  # frozen: its .grad stays what it was, as one by one
                own = param.grad
                if own is not None and own.data_ptr() == row.data_ptr():
                    continue
                if own is None or _views(own, self._pointed[name]):
                    if pointed and after_backward:
                        _zeroed_alone(name)  # too late to tell old from new: keep both
                    elif pointed:
                        row.zero_()  # the member's grad was zeroed on its own
                elif pointed:
                    row.copy_(own)
                else:
                    row.add_(own)
                param.grad = row
            self._pointed[name] = grad
            self._seen[name] = list(map(_grad_pointer, members))

    def _drop_stale(self, name: str, members: Sequence[torch.Tensor]) -> None:
        """stack.grad was set to None (zero_grad): the members' views of it go too."""
        old = self._pointed[name]
        if old is None:
            return
        for param in members:
            if param.grad is not None and _views(param.grad, old):
                param.grad = None
        self._pointed[name] = None


def _zeroed_alone(name: str) -> None:
    _logger.warning(
        "Fanout: a member's %s.grad was set to None on its own between a call and its "
        "backward, while Fanout.parameters() holds the gradients: its row of the stack's "
        ".grad keeps the gradient from before too; zero gradients through the optimizer "
        "over fan.parameters(), or before the call",
        name,
    )


def _alike(stack: torch.Tensor, members: Sequence[torch.Tensor]) -> bool:
    row = (stack.dtype, stack.device, stack.shape[1:])
    return all((p.dtype, p.device, p.shape) == row for p in members)


def _grad_pointer(param: torch.Tensor) -> int:
    grad = param.grad
    return -1 if grad is None else grad.data_ptr()


def _views(tensor: torch.Tensor, grad: torch.Tensor | None) -> bool:
    return grad is not None and (
        tensor.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    )


class _RowsOf(torch.autograd.Function):
    """Every stack's rows (views sharing its memory and version counter), name-major;
    backward gives each stack its rows' gradients in one piece."""

    @staticmethod
    def forward(ctx: Any, *stacks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.counts = [stack.shape[0] for stack in stacks]
        return tuple(
            alone.select(0, i) for stack in stacks for alone in [stack.detach()]
            for i in range(stack.shape[0])
        )  # fmt: skip

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Grads of rows that took no part arrive as zeros (materialized): stack them all.
        out, at = [], 0
        for count in ctx.counts:
            out.append(torch.stack(grads[at : at + count]))
            at += count
        return tuple(out)
