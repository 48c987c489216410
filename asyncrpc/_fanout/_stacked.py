"""Stacked members: modules of one architecture run as one batched call (engine "vmap").

Several small members are several small GEMMs; stacked, they are one batched
GEMM, which keeps the cores busy where threads and `jit.fork` cannot (small
members, small batches, few cores)::

    Fanout(members, engine="vmap")
      decline(members) ── a reason, or None: one class and layout, equal
                          settings, parameters to stack, no RNN kernels
    call(x)
      weights ── torch.stack of each parameter and buffer over the members;
                 kept while no member's tensors changed (objects, versions, data), so
                 an optimizer step on a member is seen by the next call
        ├─ nn.Sequential of Linear and element-wise layers:
        │    one torch.baddbmm per Linear over every member at once
        └─ any other module: torch.func.vmap(functional_call) over the stack
      outputs, split along the member axis, in member order

The first stacked call is checked against the members run one by one; a
difference, or a forward vmap cannot run, declines the engine for good
(`Declined`) and that call's results come from the members themselves.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._core import _torch

__all__ = ["Declined", "Stacked", "decline"]

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]
Weights = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # parameters, buffers

# Layers applied to the stacked activations as they are (element-wise).
_ELEMENTWISE = (
    torch.nn.ReLU,
    torch.nn.ReLU6,
    torch.nn.LeakyReLU,
    torch.nn.ELU,
    torch.nn.GELU,
    torch.nn.SiLU,
    torch.nn.Mish,
    torch.nn.Tanh,
    torch.nn.Sigmoid,
    torch.nn.Softplus,
    torch.nn.Hardtanh,
    torch.nn.Identity,
)
_STATE = frozenset({"_parameters", "_buffers", "_modules", "training"})
RNN_REASON = (
    "holds an {name}: torch.func.vmap has no batching rule for torch's fused RNN "
    "kernels, and 4 BiLSTMs (T=50, B=8, C=256) written as one stacked-GEMM LSTM ran "
    "2x slower than one by one on a 2-core CPU (51 vs 26 ms, 2026-11-23): oneDNN's "
    "fused LSTM beats batched GEMMs plus per-step element-wise ops; threads and fork "
    "run them"
)


class Declined(Exception):
    """The stacked engine cannot run these members; the message says why.

    Raised by a call, it carries that call's `results`, from the members themselves.
    """

    def __init__(self, reason: str, results: list[Any] | None = None) -> None:
        super().__init__(reason)
        self.results = results


def decline(members: Sequence[Any]) -> str | None:
    """Why these members cannot run stacked, or None when they can."""
    try:
        _check(members)
    except Declined as reason:
        return str(reason)
    return None


def _check(members: Sequence[Any]) -> None:
    first = members[0]
    for i, member in enumerate(members):
        if not isinstance(member, torch.nn.Module):
            raise Declined(f"member {i} is a {type(member).__name__}, not an nn.Module")
        if isinstance(member, torch.jit.ScriptModule):
            raise Declined(f"member {i} is a TorchScript module (engine='fork' runs those)")
        if type(member) is not type(first):
            raise Declined(
                f"member {i} is a {type(member).__name__}, member 0 a {type(first).__name__}"
            )
    for sub in first.modules():
        if isinstance(sub, torch.nn.RNNBase):
            raise Declined("member 0 " + RNN_REASON.format(name=type(sub).__name__))
    for i, member in enumerate(members):
        for name, sub in member.named_modules():
            if _torch.has_forward_hooks(sub):
                where = f"layer {name!r}" if name else "module"
                raise Declined(
                    f"member {i}'s {where} has forward hooks; a stacked call skips them"
                )
    if not dict(first.named_parameters()):
        raise Declined("the members have no parameters to stack")
    for i, member in enumerate(members[1:], start=1):
        _check_same(first, member, i)


def _check_same(first: torch.nn.Module, member: torch.nn.Module, i: int) -> None:
    ours = dict(first.named_modules(remove_duplicate=False))
    theirs = dict(member.named_modules(remove_duplicate=False))
    if ours.keys() != theirs.keys():
        raise Declined(f"member {i}'s layers differ from member 0's")
    for name, sub in ours.items():
        other = theirs[name]
        if type(sub) is not type(other):
            raise Declined(f"member {i}'s layer {name!r} is a {type(other).__name__}")
        for ours_table, theirs_table in zip(
            _torch.tensor_tables(sub), _torch.tensor_tables(other), strict=True
        ):
            _check_tensors(ours_table, theirs_table, name, i)
        _check_settings(sub, other, name, i)


def _check_tensors(ours: dict[str, Any], theirs: dict[str, Any], where: str, i: int) -> None:
    if ours.keys() != theirs.keys():
        raise Declined(f"member {i}'s tensors in {where or 'the module'!r} differ in name")
    for key, tensor in ours.items():
        other = theirs[key]
        same = (tensor is None) == (other is None) and (
            tensor is None
            or (tensor.shape, tensor.dtype, tensor.device)
            == (other.shape, other.dtype, other.device)
        )
        if not same:
            raise Declined(f"member {i}'s {where + '.' if where else ''}{key} differs in shape")


def _check_settings(sub: torch.nn.Module, other: torch.nn.Module, where: str, i: int) -> None:
    # Plain attributes are settings every member must share (a scale, a slope):
    # stacking runs member 0's code with every member's tensors.
    for key, value in vars(sub).items():
        if key in _STATE or key.endswith("hooks") or key.startswith("_"):
            continue
        if isinstance(value, torch.Tensor):
            raise Declined(
                f"{where or 'the module'}.{key} is a tensor that is neither a parameter "
                "nor a buffer, so it cannot be stacked; register it with register_buffer"
            )
        try:
            equal = bool(value == vars(other).get(key, object()))
        except Exception:
            equal = False
        if not equal:
            raise Declined(f"member {i}'s {where or 'module'}.{key} differs from member 0's")


def _chain(member: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The layers of a Linear/element-wise nn.Sequential, or None for anything else."""
    if type(member) is not torch.nn.Sequential:
        return None
    layers = list(member)
    if not any(isinstance(layer, torch.nn.Linear) for layer in layers):
        return None
    if all(type(layer) is torch.nn.Linear or type(layer) in _ELEMENTWISE for layer in layers):
        return layers
    return None


class Stacked:
    """Runs the members (checked with `decline`) as one batched call."""

    def __init__(self, members: Sequence[torch.nn.Module]) -> None:
        self.members = tuple(members)
        self.count = len(members)
        self.layers = _chain(members[0])
        self.linear_weights = frozenset(
            f"{i}.weight"
            for i, layer in enumerate(self.layers or ())
            if isinstance(layer, torch.nn.Linear)
        )
        self.template = copy.deepcopy(members[0]).to("meta")  # the code, not the weights
        self.subs = [list(m.modules()) for m in members]
        self.every_sub = [sub for subs in self.subs for sub in subs]
        # Where each member holds its tensors, read on every call: what it holds now.
        slots = [slot for m in members for slot in _slots(m)]
        self.tables, self.names = [t for t, _ in slots], [n for _, n in slots]
        self.checked = False
        # (key, weights): one attribute, so a thread never pairs a key with other weights
        self._cache: tuple[tuple[Any, ...], Weights] | None = None

    def run(self, calls: Calls, serial: Callable[[], list[Any]]) -> list[Any]:
        """The members' outputs for `calls`; `serial()` where this call cannot be stacked.

        Raises `Declined` (after running `serial` for this call's results)
        when the engine must not be used again.
        """
        try:
            outputs = self._batched(calls)
        except _Unstackable:
            return serial()
        except Exception as error:
            results = serial()  # a member's own error comes from here, named
            reason = f"vmap cannot run their forward: {_first_line(error)}"
            raise Declined(reason, results) from error
        if not self.checked:
            results = serial()
            difference = _difference(outputs, results)
            if difference is not None:
                reason = f"stacked outputs differ from the members' ({difference})"
                raise Declined(reason, results)
            self.checked = True
        return outputs

    def _batched(self, calls: Calls) -> list[Any]:
        if _torch.global_forward_hooks():  # nn.modules.module.register_module_forward_hook
            raise _Unstackable("module forward hooks are registered for every module")
        # A chain's layers (Linear, element-wise) act alike in either mode: its
        # members' modes are not read (~80 us a call, after a call has streamed
        # the weights through the caches).
        training = False if self.layers is not None else self._training()
        params, buffers = self._weights(training)
        args, kwargs, dims = _batch_inputs(calls)
        if self.layers is not None and not kwargs and len(args) == 1:
            each = dims[0] is not None
            if _is_rows(args[0], each):
                return list(self._run_chain(params, args[0], each).unbind(0))
        return self._run_vmap(params, buffers, args, kwargs, dims)

    def _training(self) -> bool:
        """The members' one mode; _Unstackable where they differ or buffers would change."""
        modes = set(map(_mode_of, self.every_sub))
        if len(modes) > 1:
            raise _Unstackable("members are partly in training mode")
        training = modes.pop()
        if training and any(True for _ in self.members[0].buffers()):
            raise _Unstackable("buffers are updated in training mode")
        return bool(training)

    def _weights(self, training: bool) -> Weights:
        # Read per call, so C-level maps: a Python loop over ~100 tensors cost ~100 us.
        held = map(operator.getitem, self.tables, self.names)
        tensors = [t for t in held if t is not None]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if grad:  # stacked inside the graph, so gradients reach every member's tensors
            return self._stacked()
        # A tensor replaced (another object), changed in place (its version) or given
        # other data (`.data = ...`, `.to(...)`: its data pointer) is stacked again.
        key = (
            training,
            torch.is_inference_mode_enabled(),
            tuple(map(id, tensors)),
            _torch.tensor_versions(tensors),
            tuple(map(torch.Tensor.data_ptr, tensors)),
        )
        cache = self._cache
        if cache is None or cache[0] != key:
            with torch.no_grad():
                cache = self._cache = (key, self._stacked())
        return cache[1]

    def _stacked(self) -> Weights:
        params = [dict(m.named_parameters()) for m in self.members]
        buffers = [dict(m.named_buffers()) for m in self.members]
        # A chain's Linear weights are stacked transposed, (members, in, out), the
        # layout torch.bmm reads fastest (read as it is, a batch-1 call is 1.3x slower).
        flip = self.linear_weights
        return (
            {k: torch.stack([p[k].T if k in flip else p[k] for p in params]) for k in params[0]},
            {k: torch.stack([b[k] for b in buffers]) for k in buffers[0]},
        )

    def _run_chain(self, params: dict[str, torch.Tensor], x: torch.Tensor, each: bool) -> Any:
        assert self.layers is not None
        h = x if each else x.expand(self.count, *x.shape)
        for index, layer in enumerate(self.layers):
            if type(layer) is not torch.nn.Linear:
                h = layer(h)
                continue
            weight = params[f"{index}.weight"]  # stacked transposed
            bias = params.get(f"{index}.bias")
            if bias is None:
                h = torch.bmm(h, weight)
            else:
                h = torch.baddbmm(bias.unsqueeze(1), h, weight)
        return h

    def _run_vmap(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dims: tuple[int | None, ...],
    ) -> list[Any]:
        template = self.template
        template.train(self.members[0].training)
        for sub, real in zip(template.modules(), self.subs[0], strict=True):
            sub.training = real.training

        def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *a: Any) -> Any:
            return torch.func.functional_call(template, (p, b), a, kwargs)

        flip = self.linear_weights  # back from the chain's layout
        params = {k: v.transpose(1, 2) if k in flip else v for k, v in params.items()}
        vmapped = torch.func.vmap(one, in_dims=(0, 0, *dims), randomness="different")
        return _split(vmapped(params, buffers, *args), self.count)


def _slots(member: torch.nn.Module) -> list[tuple[dict[str, Any], str]]:
    """Each parameter and buffer of `member`: (the table it is held in, its name)."""
    return [
        (table, name)
        for sub in member.modules()
        for table in _torch.tensor_tables(sub)
        for name in table
    ]


_mode_of = operator.attrgetter("training")


class _Unstackable(Exception):
    """This call cannot run stacked (its inputs, the members' mode); the next may."""


Inputs = tuple[tuple[Any, ...], dict[str, Any], tuple[int | None, ...]]


def _batch_inputs(calls: Calls) -> Inputs:
    """The arguments for one batched call, and which of them are stacked (dim 0)."""
    first_args, kwargs = calls[0]
    if all(call is calls[0] for call in calls[1:]):  # one call for all: nothing to stack
        return first_args, kwargs, (None,) * len(first_args)
    if any(k for _, k in calls) or len({len(a) for a, _ in calls}) != 1:
        raise _Unstackable("the calls' arguments differ in form")
    args: list[Any] = []
    dims: list[int | None] = []
    for column in zip(*(a for a, _ in calls), strict=True):
        if all(isinstance(v, torch.Tensor) for v in column):
            if len({v.shape for v in column}) != 1:
                raise _Unstackable("the members' inputs differ in shape")
            args.append(torch.stack(column))
            dims.append(0)
        elif all(v is column[0] for v in column):
            args.append(column[0])
            dims.append(None)
        else:
            raise _Unstackable("the members' inputs are not tensors of one shape")
    return tuple(args), {}, tuple(dims)


def _is_rows(x: Any, each: bool) -> bool:
    """A (batch, features) input: shared by all, or one per member (stacked)."""
    return isinstance(x, torch.Tensor) and x.dim() == (3 if each else 2)


def _split(out: Any, count: int) -> list[Any]:
    if isinstance(out, torch.Tensor):
        return list(out.unbind(0))
    if isinstance(out, (tuple, list)):
        columns = [_split(item, count) for item in out]
        return [type(out)(column[i] for column in columns) for i in range(count)]
    if isinstance(out, dict):
        split = {key: _split(value, count) for key, value in out.items()}
        return [{key: parts[i] for key, parts in split.items()} for i in range(count)]
    raise _Unstackable(f"the members return a {type(out).__name__}")


def _difference(stacked: list[Any], serial: list[Any]) -> str | None:
    for i, (a, b) in enumerate(zip(stacked, serial, strict=True)):
        ours, theirs = _leaves(a), _leaves(b)
        if len(ours) != len(theirs):
            return f"member {i}: {len(ours)} tensors where its own forward gives {len(theirs)}"
        for x, y in zip(ours, theirs, strict=True):
            if x.shape != y.shape:
                return f"member {i}: shape {tuple(x.shape)} where its own is {tuple(y.shape)}"
            if not torch.allclose(x, y, rtol=1e-4, atol=1e-5):
                return f"member {i}: largest difference {(x - y).abs().max().item():.3g}"
    return None


def _leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.detach()]
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in _leaves(item)]
    if isinstance(out, dict):
        return [leaf for value in out.values() for leaf in _leaves(value)]
    return []


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
