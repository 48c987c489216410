"""A world torch started and asyncrpc adopted, ended by torch's own `rpc.shutdown()`,
then at once a world of asyncrpc's: the new world makes its own state.

The adopted world's guard notices torch's shutdown within 0.2 s; a world
started sooner ends the adopted one first, and must not take over its side
channel (cancels would go to the dead world's store) or its runtime.

    python tests/programs/adopted_then_init.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed.rpc as rpc

import asyncrpc
from asyncrpc._core import _runtime, _watcher

from helpers import fail, free_port


async def wait_forever() -> None:
    await torch.futures.Future()


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rpc.init_rpc("w0", rank=0, world_size=1)
    assert asyncrpc.rpc_sync("w0", torch.add, args=(torch.ones(1), 1)).item() == 2  # adopted
    adopted = _runtime.SLOT.runtime
    rpc.shutdown()
    asyncrpc.init(rank=0, world_size=1, master_port=0)  # at once: before the guard looks
    runtime = _runtime.SLOT.runtime
    if runtime is adopted or runtime.adopted is not None:
        fail("the new world took over the adopted world's runtime")
    channel = _watcher.side_channel()
    if channel is None or channel[2] != "asyncrpc/0/side/":
        fail(f"the new world's side channel is not its own: {channel}")
    fut = asyncrpc.rpc_async("worker0", wait_forever)
    if not fut.cancel():
        fail("the cancel was refused")
    try:
        fut.wait()
        fail("the cancelled call returned")
    except asyncrpc.CancelledError:
        pass
    asyncrpc.shutdown()
    print("adopted then init OK", flush=True)


if __name__ == "__main__":
    main()
