"""A torch that lacks a private hook: starting a world fails by name, and leaves nothing.

    python tests/programs/missing_hook.py

Stands in for an untested torch by adding a hook that does not exist to the
list the torch boundary checks; then puts the list back and starts the world again.
"""

from types import MappingProxyType

import torch

import asyncrpc
from asyncrpc._core import _runtime, _torch
from asyncrpc._core._torch import _install

if __name__ == "__main__":
    core = _install.CORE_HOOKS
    _install.CORE_HOOKS = MappingProxyType({**core, "torch._C._no_such_hook": lambda: None})
    try:
        asyncrpc.init(rank=0, world_size=1, master_port=0)
    except asyncrpc.UnsupportedTorchError as exc:
        print(f"refused: {exc}")
    left = _runtime.running_world() is not None or _torch.agent_running()
    assert not left, "a failed start left a world"
    assert "__await__" not in vars(torch._C.Future), "a failed start left patches"
    _install.CORE_HOOKS = core
    with asyncrpc.init(rank=0, world_size=1, master_port=0) as ctx:
        print(f"started after: {asyncrpc.rpc_sync(ctx.name, str.upper, args=('ok',))}")
