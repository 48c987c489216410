"""`install` and `uninstall`: every process-wide patch a world needs, and putting torch back.

`install` checks first that this torch has every private name the patches
reach (`CORE_HOOKS`), then patches through each concern's module, in one
order (`uninstall` undoes them in reverse): `__await__`, the reads
(`_reads`), the RRef pickling (`_rrefs`), the `asyncrpc-store://`
rendezvous scheme. Nothing is patched at import.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._C import _distributed_rpc as _rpc_c
from torch._C._distributed_rpc import PyRRef
from torch.distributed.rpc import api as _rpc_api
from torch.distributed.rpc import internal as _rpc_internal

from .. import _runtime
from ._notes import Notes
from ._originals import FutureType
from ._patches import Hooks, Patches, install_await
from ._reads import patch_reads
from ._rrefs import patch_pickling
from ._versions import require

__all__ = ("CORE_HOOKS", "install", "uninstall")

# A module that `torch.distributed` shadows with a function of the same name.
_rendezvous_module: Any = importlib.import_module("torch.distributed.rendezvous")

# Every private name the boundary patches or calls on a call's path, by its dotted name.
CORE_HOOKS: Mapping[str, Callable[[], object]] = types.MappingProxyType(
    {
        "torch._C.Future._set_unwrap_func": lambda: FutureType._set_unwrap_func,
        "torch._C._collect_all": lambda: torch._C._collect_all,
        "torch._C._distributed_rpc.PyRRef._get_future": lambda: PyRRef._get_future,
        "torch._C._distributed_rpc.TensorPipeAgent.store": lambda: getattr(
            _rpc_c.TensorPipeAgent, "store", None
        ),
        "torch._C._distributed_rpc._invoke_rpc_python_udf": lambda: _rpc_c._invoke_rpc_python_udf,
        "torch._C._distributed_rpc._is_current_rpc_agent_set": lambda: (
            _rpc_c._is_current_rpc_agent_set
        ),
        "torch.distributed.rpc.api._default_pickler": lambda: _rpc_api._default_pickler.serialize,
        "torch.distributed.rpc.api._thread_local_var": lambda: _rpc_api._thread_local_var,
        "torch.distributed.rpc.internal.PythonUDF": lambda: _rpc_internal.PythonUDF,
        "torch.distributed.rpc.internal._InternalRPCPickler._py_rref_reducer": lambda: (
            _rpc_internal._internal_rpc_pickler._py_rref_reducer
        ),
        "torch.distributed.rpc.internal._InternalRPCPickler._py_rref_receiver": lambda: vars(
            _rpc_internal._InternalRPCPickler
        ).get("_py_rref_receiver"),
        "torch.distributed.rpc.internal.RemoteException": lambda: _rpc_internal.RemoteException,
        "torch.distributed.rpc.internal._handle_exception": lambda: (
            _rpc_internal._handle_exception
        ),
        "torch.distributed.rendezvous._rendezvous_handlers": lambda: (
            _rendezvous_module._rendezvous_handlers
        ),
        "torch.jit._builtins._find_builtin": lambda: torch.jit._builtins._find_builtin,
    }
)


def install(hooks: Hooks) -> None:
    """Install every process-wide patch a world needs (once; `uninstall` undoes them).

    torch Futures become awaitable and cancellable (`fut.cancel()`); reading a
    tagged Future, `to_here()` and `local_value()` raise carried failures and
    name torch's; the `asyncrpc-store://` rendezvous scheme exists for
    asyncrpc's `init_rpc`.
    """
    patches = _runtime.part(Patches)
    with patches.lock:
        if (id(FutureType), "wait") in patches.patched:
            return
        require(CORE_HOOKS)
        install_await(hooks.await_future)
        patch_reads(patches, hooks)
        patch_pickling(patches, hooks)
        patches.patch(_rendezvous_module._rendezvous_handlers, "asyncrpc-store", hooks.handoff)
        patches.hooks = hooks


def uninstall() -> None:
    """Put back everything `install` and `install_await` changed in torch, newest first.

    What closing the world's `Patches` part does, and the tags of its calls
    forgotten; uninstalling twice is uninstalling once.
    """
    _runtime.part(Patches).close()
    _runtime.part(Notes).tags.clear()
