"""Which settings a class of the user's own can read in a call: names found in its bytecode.

Library modules hold values the allowlist cannot prove immutable but that only
`__init__` reads: torchrl's `MLP` keeps `num_cells` (a list) and
`activation_kwargs` (a dict), SB3's policies a gym space. A value that no code
a call runs can name cannot change what a stacked call computes, so such a
setting is not one (`readable`)::

    forward, and every method or property of the class it names (transitively)
        ── the attribute names in their code (co_names, nested code too)
           and in the forward of each torch layer the class derives from

The proof holds only while that code uses `self` for `self.<name>` alone: a
`self` handed on whole (`helper(self)`, `isinstance(self, ...)`, a closure over
it), or any of `getattr`, `vars`, `__dict__`, ..., and every setting counts as
read. Torch layers' own code reads only torch's own names.
"""

from __future__ import annotations

import dis
import types
import weakref
from collections.abc import Iterator

import torch

__all__ = ("own_classes", "readable")

# Names through which code reads an attribute it does not name.
_INDIRECT = frozenset({
    "getattr", "hasattr", "setattr", "delattr", "vars", "__dict__", "__getattribute__",
    "__getattr__", "attrgetter", "getattr_static", "locals", "globals", "eval", "exec",
})  # fmt: skip
# What may follow `self` in the bytecode: it is then `self.<name>`.
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR",
                            "LOAD_SUPER_ATTR"})  # fmt: skip
_SELF_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK"})
_found: weakref.WeakKeyDictionary[type, frozenset[str] | None] = weakref.WeakKeyDictionary()


def readable(cls: type, own: tuple[type, ...], layers: tuple[type, ...]) -> frozenset[str] | None:
    """The attribute names a call of `cls` can read, or None when that cannot be proved.

    `own` are the classes of the user's own in `cls`'s MRO (code read here),
    `layers` the torch layers it derives from (their forward's names count).
    """
    if cls not in _found:
        _found[cls] = _readable(own, layers)
    return _found[cls]


def _readable(own: tuple[type, ...], layers: tuple[type, ...]) -> frozenset[str] | None:
    code_of: dict[str, list[types.CodeType]] = {}
    for base in own:
        for name, value in vars(base).items():
            code_of.setdefault(name, []).extend(_codes(value))
    names: set[str] = {"training"}
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for code in code_of.get(name, []):
            if _hands_on_self(code):
                return None
            for found in _names(code):
                names.add(found)
                if found in code_of:
                    todo.append(found)
    for layer in layers:
        forward = vars(layer).get("forward")
        if isinstance(forward, types.FunctionType):
            names.update(_names(forward.__code__))
    if names & _INDIRECT:
        return None
    return frozenset(names)


def _codes(value: object) -> Iterator[types.CodeType]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for part in (value.fget, value.fset, value.fdel):
            if isinstance(part, types.FunctionType):
                yield part.__code__
    elif isinstance(value, types.FunctionType):
        yield value.__code__


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _hands_on_self(code: types.CodeType) -> bool:
    """True when `code` (a method) uses its first argument other than as `self.<name>`."""
    if code.co_argcount == 0:
        return bool(code.co_varnames) and code.co_flags & 0x04 != 0  # *args: self inside
    me = code.co_varnames[0]
    if me in code.co_cellvars:  # a closure over self
        return True
    ops = list(dis.get_instructions(code))
    for here, op in enumerate(ops):
        if op.argval == me and op.opname not in _SELF_LOADS and "FAST" in op.opname:
            return True  # self stored to, or loaded by a combined instruction
        if op.opname in _SELF_LOADS and op.argval == me:
            after = ops[here + 1].opname if here + 1 < len(ops) else ""
            if after not in _ATTRIBUTE_OPS:
                return True
    return False


def own_classes(cls: type, layers: frozenset[type]) -> tuple[tuple[type, ...], tuple[type, ...]]:
    """`cls`'s MRO up to nn.Module, split: the user's own classes, and torch layers."""
    own: list[type] = []
    known: list[type] = []
    for base in cls.__mro__:
        if base is torch.nn.Module:
            break
        (known if base in layers else own).append(base)
    return tuple(own), tuple(known)
