"""What the ensemble engine reads of nn.Modules and tensors that torch keeps private.

The tables a module's parameters, buffers, submodules and hooks live in,
the hooks and version counter of a tensor, the memory it shares, and the
swap that makes a tensor a view of a stack's row. Only `_fanout` uses these.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = (
    "any_tensor_hooks",
    "call_hook_tables",
    "global_call_hook_tables",
    "hook_registrar",
    "hook_tables",
    "impl_id",
    "is_compiled",
    "is_parametrized",
    "module_tables",
    "share_version",
    "storage_shared",
    "tensor_hooks",
    "tensor_tables",
    "tensor_version",
)


def tensor_tables(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tables a module's own parameters and buffers live in (name -> tensor or None).

    Assigning a parameter (`layer.weight = ...`) replaces its entry in the same
    table, so reading the tables sees what the module holds now.
    """
    return module._parameters, module._buffers


def module_tables(module: torch.nn.Module) -> dict[str, Any]:
    """The table a module's own submodules live in (name -> module or None)."""
    return module._modules


def is_parametrized(module: torch.nn.Module) -> bool:
    """True for a module with torch.nn.utils.parametrize parametrizations."""
    return bool(torch.nn.utils.parametrize.is_parametrized(module))


def is_compiled(module: torch.nn.Module) -> bool:
    """True for torch.compile's wrapper of a module (an OptimizedModule, `_orig_mod` inside)."""
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def hook_tables(module: torch.nn.Module) -> dict[str, dict[Any, Any]]:
    """Every hook table `module` holds, by name (`_forward_hooks`, `_state_dict_hooks`, ...).

    Read as every `_...hook...` dict in the module's `__dict__`, so a table a
    later torch adds is found too.
    """
    return {
        name: table
        for name, table in vars(module).items()
        if name.startswith("_") and "hook" in name and isinstance(table, dict)
    }


# The public way to add a hook to each of nn.Module's tables (`hook_tables`' names).
_REGISTRARS: Mapping[str, str] = types.MappingProxyType(
    {
        "_forward_hooks": "register_forward_hook",
        "_forward_pre_hooks": "register_forward_pre_hook",
        "_backward_hooks": "register_full_backward_hook",
        "_backward_pre_hooks": "register_full_backward_pre_hook",
        "_state_dict_hooks": "register_state_dict_post_hook",
        "_state_dict_pre_hooks": "register_state_dict_pre_hook",
        "_load_state_dict_pre_hooks": "register_load_state_dict_pre_hook",
        "_load_state_dict_post_hooks": "register_load_state_dict_post_hook",
    }
)


def hook_registrar(table: str) -> str | None:
    """The nn.Module method that adds a hook to the table `hook_tables` names `table`, or None."""
    return _REGISTRARS.get(table)


_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def call_hook_tables(module: torch.nn.Module) -> list[dict[Any, Any]]:
    """The hook tables torch reads when `module` is called (forward, backward; pre and post)."""
    tables = vars(module)
    return [tables[name] for name in _CALL_HOOKS]


def global_call_hook_tables() -> list[dict[Any, Any]]:
    """The tables of hooks for every module torch reads on each call (register_module_*_hook)."""
    from torch.nn.modules import module as _module

    return [getattr(_module, "_global" + name) for name in _CALL_HOOKS]


_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def tensor_hooks(tensor: torch.Tensor) -> bool:
    """True when `tensor` has hooks (register_hook, register_post_accumulate_grad_hook)."""
    return any(getattr(tensor, name, None) for name in _TENSOR_HOOKS)


def any_tensor_hooks(tables: Sequence[dict[str, Any]]) -> bool:
    """True when a tensor in `tables` (name -> tensor or None) has hooks; a C-level scan."""
    for name in _TENSOR_HOOKS:
        tensors = itertools.chain.from_iterable(map(dict.values, tables))
        if any(map(getattr, tensors, itertools.repeat(name), itertools.repeat(None))):
            return True
    return False


def tensor_version(tensor: torch.Tensor) -> int:
    """`tensor`'s version counter: an in-place change to it (or a view sharing it) bumps it."""
    return int(tensor._version)


def storage_shared(tensor: torch.Tensor) -> bool:
    """True when another tensor (a view, `.data` held somewhere) shares `tensor`'s memory.

    Counts the references to its storage: the tensor's own and the storage
    object made to ask (torch's private `_storage_Use_Count`).
    """
    storage = tensor.untyped_storage()
    return int(torch._C._storage_Use_Count(storage._cdata)) > 2


def share_version(tensor: torch.Tensor, row: torch.Tensor) -> bool:
    """Make `tensor` (the same Python object) a view of `row` that shares `row`'s version counter.

    `tensor.data = row` shares the memory only; the counter stays the tensor's,
    so autograd would not see in-place changes made through the tensor. This
    swaps in a tensor made from `row` (`torch.utils.swap_tensors`), keeping the
    class, attributes, `requires_grad` and `.grad`. False, changing nothing,
    where that cannot be done safely: something else holds the tensor's C++
    object (a live autograd graph that reads it; torch's private `_use_count`),
    or it has a weak reference, hooks, a history, or is an inference tensor.
    """
    if (
        not tensor.is_leaf
        or tensor.is_inference()
        or int(tensor._use_count()) != 1  # type: ignore[attr-defined]
        or weakref.getweakrefs(tensor)
        or tensor_hooks(tensor)
    ):
        return False
    cls = type(tensor)
    if cls is torch.Tensor:
        twin = row.detach().requires_grad_(tensor.requires_grad)
    else:
        twin = torch.Tensor._make_subclass(cls, row, tensor.requires_grad)
    twin.grad = tensor.grad
    twin.__dict__.update(tensor.__dict__)
    torch.utils.swap_tensors(tensor, twin)  # type: ignore[no-untyped-call]
    return True


def impl_id(tensor: torch.Tensor) -> int:
    """The address of the C++ object behind `tensor` (torch's private `_cdata`)."""
    return int(tensor._cdata)
