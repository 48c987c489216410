"""Stacked members: modules of one architecture run as one batched call (engine "vmap").

Several small members are several small GEMMs; stacked, they are one batched
GEMM, which keeps the cores busy where threads and `jit.fork` cannot (small
members, small batches, few cores)::

    Fanout(members, engine="vmap")
      decline(members) ── a reason, or None (_decline)
    first call ── members one by one: this call's results
              └─ on copies of the members, stacked and one by one compared
                 (outputs, buffers, attributes; in eval mode if the forward
                 draws random numbers): a difference declines the engine
                 for good (`Declined`); else the members' tensors become
                 rows of the stacks (_storage)
    every call ── attributes alike? (_attributes)    no: one by one
                  tensors where the stacks hold them? (_storage: re-pointed)
        ├─ nn.Sequential of Linear, LayerNorm and element-wise layers:
        │    one torch.baddbmm per Linear over every member at once
        └─ any other module: torch.func.vmap(functional_call) over the stacks
      outputs, split along the member axis, in member order

With gradients on, the stacked call reads each stack through `_Rows`, whose
output is the stack itself (its version counter too: a member's tensor
changed in place before backward makes backward raise torch's own error, as
eager does) and whose backward hands each member's tensor its row of the
gradient; a member whose parameters and inputs need none gets outputs that
need none, as its own forward would give. With gradients on, the outputs are
one `select` view each (a view of a multi-output `unbind` refuses in-place
changes), so `out.masked_fill_(...)` works as on a member's own output.
The stacks are made when the engine is (`Stacked.__init__`), before a graph
holds the members' tensors, so the tensors can share the stacks' counters.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._core import _torch
from ._attributes import Attributes
from ._check import (
    RANDOM_REASON,
    Calls,
    detached_copy,
    deterministic,
    first_line,
    leaves,
    replay,
)
from ._decline import Declined, chain_of, decline
from ._storage import InSharedMemory, Storage, Unstackable, storage_for

__all__ = ("Stacked",)


class Stacked:
    """Runs the members (checked with `decline`) as one batched call."""

    def __init__(self, members: Sequence[torch.nn.Module]) -> None:
        self.members = tuple(members)
        self.count = len(members)
        self.storage: Storage | None = None  # the stacks the members' tensors are rows of
        self._checked = False  # the first call's check passed: calls run stacked
        self._first = threading.Lock()
        self._read_structure()

    def _stack_early(self) -> None:
        """Stack now, while no autograd graph holds the members' tensors (see _storage)."""
        try:
            self.storage = storage_for(self.members)
        except Unstackable:
            self.storage = None  # the first call says why

    def _read_structure(self) -> None:
        """What depends on the members' layers: the code to run and what to read per call."""
        first = self.members[0]
        self.layers = chain_of(first)
        self.template = copy.deepcopy(first).to("meta")  # the code, not the weights
        self.attributes = _attributes_of(self.members, self.template, self.layers is not None)
        self.has_buffers = any(True for _ in first.buffers())
        # Every submodule table, read each call: a layer replaced (`m[2] = nn.Linear(...)`,
        # `m.head = ...`) has other tensors, attributes and code.
        self._tables = [_torch.module_tables(sub) for m in self.members for sub in m.modules()]
        self._structure = self._read_tables()
        self._stack_early()

    def _read_tables(self) -> list[tuple[Any, ...]]:
        return list(map(tuple, map(dict.values, self._tables)))

    def _restructure(self, serial: Callable[[], list[Any]]) -> None:
        """A member's layers changed: check them again, and start over at the first call."""
        reason = decline(self.members)
        if reason is not None:
            raise Declined(f"after a layer was replaced: {reason}", serial())
        self.release()
        self._read_structure()

    def run(self, calls: Calls, serial: Callable[[], list[Any]]) -> list[Any]:
        """The members' outputs for `calls`; `serial()` where this call cannot be stacked.

        Raises `Declined` (after running `serial` for this call's results)
        when the engine must not be used again.
        """
        if self._read_tables() != self._structure:
            self._restructure(serial)
        if not self._stackable_now():
            return serial()
        if not self._checked or self.storage is None:
            return self._first_call(calls, serial)
        try:
            return self.batched(self.storage, calls)
        except InSharedMemory as why:
            raise Declined(str(why), serial()) from why
        except Unstackable:
            return serial()
        except Exception as error:
            results = serial()  # a member's own error comes from here, named
            reason = f"vmap cannot run their forward: {first_line(error)}"
            raise Declined(reason, results) from error

    def release(self) -> None:
        """Give the members memory of their own again (the engine is no longer used)."""
        storage, self.storage, self._checked = self.storage, None, False
        if storage is not None:
            storage.leave()

    def _stackable_now(self) -> bool:
        # a hook (a member's, a tensor's, one for every module) or an unlike setting
        if not self.attributes.alike():
            return False
        # BatchNorm and the like update their buffers in training: vmap has no rule.
        return not (self.has_buffers and self.layers is None and self.template.training)

    def _first_call(self, calls: Calls, serial: Callable[[], list[Any]]) -> list[Any]:
        with self._first:
            if self._checked and self.storage is not None:
                return self.run(calls, serial)
            try:
                copies = [copy.deepcopy(list(self.members)) for _ in range(2)]
            except Exception as error:
                results = serial()
                raise Declined(
                    f"the members cannot be copied for the first call's check "
                    f"({first_line(error)})",
                    results,
                ) from error
            try:
                inputs = [detached_copy(calls) for _ in range(2)]
            except Exception:
                # This call's arguments are the user's business, not the members': the
                # next call with arguments that copy is checked instead.
                return serial()
            results = serial()  # the call itself: the members' own state moves once
            reason = self._check(copies, inputs)
            if reason is None and self.storage is None:
                self.storage = storage_for(self.members)
            if reason is None and self.storage is not None:
                reason = self.storage.shared_memory_reason()
            if reason is not None:
                raise Declined(reason, results)
            self._checked = True
            return results

    def _check(self, copies: list[list[torch.nn.Module]], inputs: list[Calls]) -> str | None:
        """Why stacking these members would differ from running them, or None."""
        stacked_copies, own_copies = copies
        try:
            if not deterministic(own_copies[0], inputs[1][0]):
                # Dropout in training, say: masks cannot be compared; the code can.
                for member in [*stacked_copies, *own_copies]:
                    member.eval()
                if not deterministic(own_copies[0], inputs[1][0]):
                    return RANDOM_REASON
            engine = Stacked(stacked_copies)
            if not engine._stackable_now():
                return engine.attributes.difference or "the members' copies cannot be stacked"
            storage = engine.storage or Storage(stacked_copies)
            return replay(
                lambda: engine.batched(storage, inputs[0]), stacked_copies, own_copies, inputs[1]
            )
        except Unstackable as why:
            return str(why)
        except Exception as error:
            return f"vmap cannot run their forward: {first_line(error)}"

    def batched(self, storage: Storage, calls: Calls) -> list[Any]:
        """One stacked call over `storage` (the members' tensors as its rows)."""
        held = storage.sync()
        args, kwargs, dims = _batch_inputs(calls)
        before = storage.versions()
        params = self._params(storage, held)
        if (
            self.layers is not None
            and not kwargs
            and len(args) == 1
            and _is_rows(args[0], dims[0] is not None)
        ):
            outputs = _rows_of(self._run_chain(params, args[0], dims[0] is not None))
        else:
            buffers = {name: storage.stacks[name] for name in storage.buffer_names}
            outputs = self._run_vmap(params, buffers, args, kwargs, dims)
        storage.write_back(held, before)
        return self._as_members(outputs, storage, held, calls)

    def _params(self, storage: Storage, held: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parameters the call reads: the stacks, through `_Rows` where gradients flow."""
        params = {name: storage.stacks[name] for name in storage.param_names}
        if storage.grads is not None:
            # Leaves that need gradients: backward fills stack.grad in one piece. A
            # frozen member's row takes none, as its own tensor would not.
            for name in storage.param_names:
                needs = storage.grads.needs(name)
                if not any(needs):
                    params[name] = params[name].detach()
                elif not all(needs):
                    mask = torch.tensor(
                        needs, dtype=params[name].dtype, device=params[name].device
                    )
                    params[name] = _Frozen.apply(params[name], mask)  # type: ignore[no-untyped-call]
            return params
        if torch.is_grad_enabled():
            for name in storage.param_names:
                group = storage.group(held, name)
                if any(t.requires_grad for t in group):
                    params[name] = _Rows.apply(params[name], *group)  # type: ignore[no-untyped-call]
        return params

    def _as_members(
        self, outputs: list[Any], storage: Storage, held: list[torch.Tensor], calls: Calls
    ) -> list[Any]:
        """Outputs whose `requires_grad` is what each member's own forward gives."""
        if not torch.is_grad_enabled():
            return outputs
        needs = [False] * self.count
        for name in storage.param_names:
            for i, tensor in enumerate(storage.group(held, name)):
                needs[i] = needs[i] or tensor.requires_grad
        for i, (args, kwargs) in enumerate(calls):
            if not needs[i] and any(t.requires_grad for t in leaves([args, kwargs])):
                needs[i] = True
        return [out if need else _detached(out) for out, need in zip(outputs, needs, strict=True)]

    def _run_chain(self, params: dict[str, torch.Tensor], x: torch.Tensor, each: bool) -> Any:
        assert self.layers is not None
        h = x if each else x.expand(self.count, *x.shape)
        for index, layer in enumerate(self.layers):
            if type(layer) is torch.nn.LayerNorm:
                h = _layer_norm(
                    layer, h, params.get(f"{index}.weight"), params.get(f"{index}.bias")
                )
                continue
            if type(layer) is not torch.nn.Linear:
                h = layer(h)  # member 0's: every member's is alike (_attributes)
                continue
            weight = params[f"{index}.weight"]  # (members, out, in)
            bias = params.get(f"{index}.bias")
            if bias is None:
                h = torch.bmm(h, weight.mT)
            else:
                h = torch.baddbmm(bias.unsqueeze(1), h, weight.mT)
        return h

    def _run_vmap(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dims: tuple[int | None, ...],
    ) -> list[Any]:
        template = self.template  # member 0's attributes and modes (_attributes)

        def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *a: Any) -> Any:
            return torch.func.functional_call(template, (p, b), a, kwargs)

        vmapped = torch.func.vmap(one, in_dims=(0, 0, *dims), randomness="different")
        return _split(vmapped(params, buffers, *args), self.count)


def _layer_norm(
    layer: torch.nn.LayerNorm,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Member 0's LayerNorm (settings alike) over (members, batch, features), each
    member's own affine: weight and bias stacks are (members, features)."""
    h = torch.nn.functional.layer_norm(h, layer.normalized_shape, None, None, layer.eps)
    if weight is not None and bias is not None:
        return torch.addcmul(bias.unsqueeze(1), h, weight.unsqueeze(1))
    if weight is not None:
        return h * weight.unsqueeze(1)
    return h


class _Frozen(torch.autograd.Function):
    """The stack as it is; backward gives frozen members' rows (mask 0) no gradient."""

    @staticmethod
    def forward(ctx: Any, stack: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mask)
        return stack.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask.view(-1, *([1] * (grad.dim() - 1))), None


class _Rows(torch.autograd.Function):
    """The stack as the members' tensors in one: its gradient goes to each member's own.

    The output is the stack detached (its memory and version counter, not a
    view in autograd's eyes), so ops that save it see in-place changes made
    through any member's tensor, and in-place writes in forward (Embedding's
    max_norm) land in the members' rows.
    """

    @staticmethod
    def forward(ctx: Any, stack: torch.Tensor, *group: torch.Tensor) -> torch.Tensor:
        return stack.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *grad.unbind(0))


def _rows_of(out: torch.Tensor) -> list[torch.Tensor]:
    """Each member's output: `select` views where autograd records (each may change in place)."""
    if out.requires_grad and torch.is_grad_enabled():
        return [out.select(0, i) for i in range(out.shape[0])]
    return list(out.unbind(0))


def _attributes_of(
    members: Sequence[torch.nn.Module], template: torch.nn.Module, chain: bool
) -> Attributes:
    # A chain's layers (Linear, element-wise) act alike in either mode: its
    # members' modes may differ.
    return Attributes(members, template, ignore=("training",) if chain else ())


def _batch_inputs(calls: Calls) -> tuple[tuple[Any, ...], dict[str, Any], tuple[int | None, ...]]:
    """The arguments for one batched call, and which of them are stacked (dim 0)."""
    first_args, kwargs = calls[0]
    if all(call is calls[0] for call in calls[1:]):  # one call for all: nothing to stack
        return first_args, kwargs, (None,) * len(first_args)
    if any(k for _, k in calls) or len({len(a) for a, _ in calls}) != 1:
        raise Unstackable("the calls' arguments differ in form")
    args: list[Any] = []
    dims: list[int | None] = []
    for column in zip(*(a for a, _ in calls), strict=True):
        if all(isinstance(v, torch.Tensor) for v in column):
            if len({v.shape for v in column}) != 1:
                raise Unstackable("the members' inputs differ in shape")
            args.append(torch.stack(column))
            dims.append(0)
        elif all(v is column[0] for v in column):
            args.append(column[0])
            dims.append(None)
        else:
            raise Unstackable("the members' inputs are not tensors of one shape")
    return tuple(args), {}, tuple(dims)


def _is_rows(x: Any, each: bool) -> bool:
    """A (batch, features) input: shared by all, or one per member (stacked)."""
    return isinstance(x, torch.Tensor) and x.dim() == (3 if each else 2)


def _split(out: Any, count: int) -> list[Any]:
    if isinstance(out, torch.Tensor):
        return _rows_of(out)
    if isinstance(out, (tuple, list)):
        columns = [_split(item, count) for item in out]
        return [type(out)(column[i] for column in columns) for i in range(count)]
    if isinstance(out, dict):
        split = {key: _split(value, count) for key, value in out.items()}
        return [{key: parts[i] for key, parts in split.items()} for i in range(count)]
    raise Unstackable(f"the members return a {type(out).__name__}")


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(item) for item in out)
    if isinstance(out, dict):
        return {key: _detached(value) for key, value in out.items()}
    return out
