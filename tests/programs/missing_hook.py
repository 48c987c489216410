"""A torch that lacks a private hook: starting a world fails by name, and leaves nothing.

    python tests/programs/missing_hook.py

Stands in for an untested torch by adding a hook that does not exist to the
list the torch boundary checks; then removes it and starts the world again.
"""

import asyncrpc
from asyncrpc._core import _torch, _world

if __name__ == "__main__":
    _torch._CORE_HOOKS["torch._C._no_such_hook"] = lambda: None
    try:
        asyncrpc.init(rank=0, world_size=1, master_port=0)
    except asyncrpc.UnsupportedTorchError as exc:
        print(f"refused: {exc}")
    left = _world.running_world() is not None or _torch.agent_running()
    assert not left, "a failed start left a world"
    assert not _torch._patched, "a failed start left patches"
    del _torch._CORE_HOOKS["torch._C._no_such_hook"]
    with asyncrpc.init(rank=0, world_size=1, master_port=0) as ctx:
        print(f"started after: {asyncrpc.rpc_sync(ctx.name, str.upper, args=('ok',))}")
