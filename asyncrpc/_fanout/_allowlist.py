"""What the "vmap" engine stacks: only modules it can prove equal to their members run alone.

A stacked call runs one module's code (member 0's, on the meta device) over
every member's tensors. That equals the members run one by one only while
nothing else a call reads differs between members or changes unseen, so the
engine admits what it can show (an allowlist) and runs the rest member by
member. Every submodule of every member must be:

- a torch layer in `LAYERS` (its forward reads only its parameters, buffers
  and settings), or a class of the user's own (`class_reason`) that defines
  none of nn.Module's names but `__init__`, `forward` and `extra_repr`, whose
  class-level values are functions or immutable, and whose bases are such
  classes, `LAYERS` or nn.Module;
- holding plain tensors: parameters of type nn.Parameter, buffers of type
  torch.Tensor, none with a tensor hook;
- holding settings (`plain_attributes`) that are immutable values (`immutable`):
  a value mutated in place (`m.bounds[0] = 5`) cannot be seen, a rebound one is;
- with no hook of any kind (`hook_reason`): forward, forward-pre, backward,
  full backward, backward-pre, state-dict and load-state-dict hooks (but the
  engine's own state-dict hook, _storage's marking of entries).

Hooks can be added after the structure was read; `CallHooks` reads the
tables torch reads on a call (the members', the global ones, and the
tensors' under grad) on every call, a C-level scan of dict lengths.
"""

from __future__ import annotations

import abc
import enum
import functools
import types
import typing
from collections.abc import Sequence
from typing import Any

import torch

from .._core import _torch
from ._alone import mark_entries
from ._reads import own_classes, readable

__all__ = [
    "LAYERS",
    "CallHooks",
    "article",
    "class_reason",
    "immutable",
    "plain_attributes",
    "same_setting",
    "unprovable",
]

_nn = torch.nn
LAYERS: frozenset[type[torch.nn.Module]] = frozenset({
    _nn.Sequential, _nn.ModuleList, _nn.ModuleDict, _nn.Identity, _nn.Flatten, _nn.Unflatten,
    _nn.Linear, _nn.Bilinear, _nn.Embedding,
    _nn.Conv1d, _nn.Conv2d, _nn.Conv3d,
    _nn.MaxPool1d, _nn.MaxPool2d, _nn.AvgPool1d, _nn.AvgPool2d,
    _nn.AdaptiveAvgPool1d, _nn.AdaptiveAvgPool2d,
    _nn.LayerNorm, _nn.RMSNorm, _nn.GroupNorm, _nn.BatchNorm1d, _nn.BatchNorm2d, _nn.BatchNorm3d,
    _nn.Dropout, _nn.Dropout1d, _nn.Dropout2d, _nn.Dropout3d,
    _nn.ReLU, _nn.ReLU6, _nn.LeakyReLU, _nn.PReLU, _nn.ELU, _nn.SELU, _nn.CELU, _nn.GELU,
    _nn.SiLU, _nn.Mish, _nn.Tanh, _nn.Sigmoid, _nn.LogSigmoid, _nn.Softplus, _nn.Softsign,
    _nn.Hardtanh, _nn.Hardswish, _nn.Hardsigmoid, _nn.Softmax, _nn.LogSoftmax, _nn.GLU,
    _nn.Tanhshrink, _nn.Softshrink, _nn.Hardshrink, _nn.Threshold,
})  # fmt: skip
# nn.Module's own bookkeeping in every instance's __dict__ (tables, hooks), not settings.
_MACHINERY = frozenset(vars(torch.nn.Module())) - {"training"}
_MODULE_NAMES = frozenset(dir(torch.nn.Module))
_OWN = frozenset({"__init__", "forward", "extra_repr"})  # what a user class may define
_PYTHON = frozenset({  # what Python puts in every class body
    "__module__", "__qualname__", "__doc__", "__annotations__", "__dict__", "__weakref__",
    "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__",
    "__annotate__", "__type_params__",
    "__abstractmethods__", "_abc_impl",  # what ABCMeta puts in a class with an ABC base
})  # fmt: skip
# Bases that add no behaviour an instance's forward could read: abc.ABC's machinery
# (`__abstractmethods__`, set by Python) and typing.Generic's.
_PLAIN_BASES = frozenset({abc.ABC, typing.Generic})
_SCALARS = frozenset({
    type(None), bool, int, float, complex, str, bytes, type(Ellipsis),
    torch.dtype, torch.device, torch.layout, torch.memory_format,
})  # fmt: skip


def plain_attributes(module: torch.nn.Module) -> dict[str, Any]:
    """A module's settings: what its forward may read besides its tensors, `training` included.

    Every entry of its `__dict__` but nn.Module's bookkeeping; of a `LAYERS`
    layer, not the `_private` ones either (torch's own, derived from its settings);
    of a class of the user's own, not those no code a call runs can name (_reads).
    """
    kind = type(module)
    known = kind in LAYERS
    names = None if known else _read_by(kind)
    return {
        key: value
        for key, value in vars(module).items()
        if key not in _MACHINERY
        and not (known and key.startswith("_"))
        and (names is None or key in names)
    }


def _read_by(kind: type) -> frozenset[str] | None:
    """The names a call of a class of the user's own can read (_reads), or None: all."""
    own, layers = own_classes(kind, LAYERS)
    if any(base.__module__.split(".")[0] == "torch" for base in own):
        return None  # a torch class the allowlist does not know: declined, read all
    return readable(kind, own, layers)


def immutable(value: object) -> bool:
    """True for a value a stacked call may read as member 0's: a number, str, dtype,
    device, None, a class, a function, or a tuple (torch.Size, a NamedTuple),
    frozenset, Enum or `functools.partial` of such values.

    A class or a function counts as a setting by identity: members alike hold the
    very same object, so member 0's code calling it calls what each member would
    (whatever state it reads, it reads for all of them, as one by one).
    """
    if type(value) in _SCALARS:
        return True
    if isinstance(value, type):  # torchrl's activation_class=nn.Tanh
        return True
    if isinstance(value, types.FunctionType):  # F.relu; not a bound method
        return True
    if isinstance(value, types.BuiltinFunctionType):  # torch.relu, not [].append
        return value.__self__ is None or isinstance(value.__self__, types.ModuleType)
    if type(value) is functools.partial:
        return (
            immutable(value.func)
            and all(map(immutable, value.args))
            and all(map(immutable, value.keywords.values()))
            and not vars(value)
        )
    if isinstance(value, (tuple, frozenset)) and not hasattr(value, "__dict__"):
        return all(map(immutable, value))
    if isinstance(value, enum.Enum):
        return immutable(value.value)
    return False


def unprovable(sub: torch.nn.Module, where: str) -> str | None:
    """Why `sub` (named `where`, e.g. "member 1's layer 'head'") cannot be stacked, or None."""
    return (
        _layer_reason(sub, where)
        or _tensor_reason(sub, where)
        or hook_reason(sub, where)
        or _settings_reason(sub, where)
    )


def _layer_reason(sub: torch.nn.Module, where: str) -> str | None:
    kind = type(sub)
    if kind in LAYERS:
        return None
    if _torch.is_compiled(sub):
        return (
            f"{where} is compiled (torch.compile's OptimizedModule), whose forward the vmap "
            "engine cannot prove; pass the module it wraps (compiled._orig_mod) to the Fanout"
        )
    if kind.__module__.split(".")[0] == "torch":
        return (
            f"{where} is {article(kind.__name__)}, a torch layer the vmap engine does not know "
            "(it stacks only the layers in asyncrpc's allowlist, see docs/ensembles.md)"
        )
    reason = class_reason(kind)
    return None if reason is None else f"{where} is {article(kind.__name__)}: {reason}"


def article(name: str) -> str:
    """`name` with "a" or "an" before it, as it is read: "an LSTM", "a GRU", "an Embedding"."""
    if len(name) > 1 and name[:2].isupper():  # an acronym: read letter by letter
        return ("an " if name[0] in "AEFHILMNORSX" else "a ") + name
    return ("an " if name[:1].upper() in "AEIOU" else "a ") + name


def same_setting(a: object, b: object) -> bool:
    """True when two members' settings are equal: `==`, or partials of equal parts."""
    if a is b:
        return True
    if type(a) is functools.partial and type(b) is functools.partial:
        return (
            same_setting(a.func, b.func)
            and len(a.args) == len(b.args)
            and all(map(same_setting, a.args, b.args))
            and a.keywords.keys() == b.keywords.keys()
            and all(same_setting(a.keywords[k], b.keywords[k]) for k in a.keywords)
        )
    try:
        return bool(a == b)
    except Exception:  # an array's ambiguous truth, say: count it as a difference
        return False


def class_reason(cls: type) -> str | None:
    """Why a class of the user's own cannot be proved, or None (see the module's docstring)."""
    for base in cls.__mro__:
        if base is torch.nn.Module:
            return None
        if base in LAYERS or base in _PLAIN_BASES:
            continue
        if base.__module__.split(".")[0] == "torch":
            return f"it derives from torch's {base.__name__}, which the vmap engine does not know"
        for name, value in vars(base).items():
            if name in _OWN or name in _PYTHON:
                continue
            if name in _MODULE_NAMES or (name.startswith("__") and name.endswith("__")):
                return (
                    f"{base.__name__} defines {name}; a class of your own is stacked only when it "
                    "defines nothing of nn.Module's but __init__, forward and extra_repr"
                )
            if isinstance(value, (types.FunctionType, staticmethod, classmethod, property)):
                continue
            if not immutable(value):
                return (
                    f"{base.__name__}.{name} is {article(type(value).__name__)}, which can change "
                    "unseen; hold class-level settings as immutable values (a number, a tuple)"
                )
    return f"{cls.__name__} is not an nn.Module"


def _tensor_reason(sub: torch.nn.Module, where: str) -> str | None:
    parameters, buffers = _torch.tensor_tables(sub)
    tables = ((parameters, torch.nn.Parameter, "parameter"), (buffers, torch.Tensor, "buffer"))
    for table, plain, kind in tables:
        for key, tensor in table.items():
            if tensor is None:
                continue
            if type(tensor) is not plain:
                return (
                    f"{where} holds {kind} {key!r}, a {type(tensor).__name__}, not a plain "
                    f"{plain.__name__}, so the vmap engine cannot prove how it is read"
                )
            if _torch.tensor_hooks(tensor):
                return (
                    f"{where} holds {kind} {key!r}, which has a tensor hook (register_hook or "
                    "register_post_accumulate_grad_hook), which the vmap engine does not run"
                )
    return None


def hook_reason(sub: torch.nn.Module, where: str) -> str | None:
    """Why `sub`'s hooks keep it from being stacked (any hook but the engine's own), or None."""
    for name, table in _torch.hook_tables(sub).items():
        if any(hook is not mark_entries for hook in table.values()):
            kind = name.strip("_").replace("_", " ")
            registrar = _torch.hook_registrar(name)
            how = f" ({registrar})" if registrar is not None else ""
            return f"{where} has {kind}{how}; a stacked call would skip them"
    return None


def _settings_reason(sub: torch.nn.Module, where: str) -> str | None:
    for key, value in plain_attributes(sub).items():
        if isinstance(value, torch.Tensor):
            return (
                f"{where} holds attribute {key!r}, a tensor that is neither a parameter nor a "
                "buffer, so it cannot be stacked; register it with register_buffer"
            )
        if not immutable(value):
            return (
                f"{where} holds attribute {key!r}, {article(type(value).__name__)}, a value "
                f"that can change in place (m.{key}[0] = ...) where a stacked call cannot see "
                "it, and the code a call runs may read it (forward or a method it names, or "
                "code that hands self on); hold it as an immutable value (a number, a tuple, a "
                "frozenset) and rebind it to change it, or give the Fanout the layers forward "
                "runs (the nn.Sequential inside) as members"
            )
    return None


class CallHooks:
    """The hooks a call would run, read on every call (a hook may be added at any time)."""

    def __init__(self, members: Sequence[torch.nn.Module]) -> None:
        self._named = [
            (f"member {i}'s {_where(name)}", sub)
            for i, member in enumerate(members)
            for name, sub in member.named_modules()
        ]
        self._tables = [t for _, sub in self._named for t in _torch.call_hook_tables(sub)]
        self._globals = _torch.global_call_hook_tables()
        self._tensors = [t for _, sub in self._named for t in _torch.tensor_tables(sub)]

    def present(self) -> bool:
        """True when a call would run a hook: a member's, a global one, a tensor's (under grad)."""
        return (
            any(map(len, self._tables))
            or any(map(len, self._globals))
            or (torch.is_grad_enabled() and _torch.any_tensor_hooks(self._tensors))
        )

    def reason(self) -> str:
        """Which hook (call only when `present()`)."""
        if any(map(len, self._globals)):
            return "hooks for every module are registered (register_module_*_hook)"
        for where, sub in self._named:
            found = hook_reason(sub, where) or _tensor_reason(sub, where)
            if found is not None:
                return found
        return "a hook was added"


def _where(name: str) -> str:
    return f"layer {name!r}" if name else "module"
