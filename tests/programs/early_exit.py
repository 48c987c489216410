"""worker1 ends with os._exit(0) while its world still runs; worker0 keeps calling worker2.

A world that does not heal must fail, naming worker1, in bounded time: the
others would otherwise wait for it in torch's graceful shutdown for good.
"""

import os
import time

import asyncrpc


def ping() -> str:
    return asyncrpc.current_context().name


def main(ctx: asyncrpc.Context) -> None:
    if ctx.name == "worker1":
        time.sleep(0.3)
        os._exit(0)  # not a return from main
    if ctx.name == "worker0":
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            asyncrpc.rpc_sync("worker2", ping)
            time.sleep(0.05)


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3)
