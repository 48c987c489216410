"""Calls asyncrpc the wrong way, named by argv[1], and prints the error."""

import sys

import torch

import asyncrpc


def case_before_init() -> None:
    asyncrpc.rpc_sync("worker1", torch.add, args=(1, 2))


def case_after_shutdown() -> None:
    with asyncrpc.init(rank=0, world_size=1, master_port=0):
        pass
    asyncrpc.rpc_async("worker0", torch.add, args=(1, 2))


def case_port_in_use() -> None:
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    asyncrpc.init(rank=0, world_size=1, master_port=holder.getsockname()[1])


def case_init_twice() -> None:
    asyncrpc.init(rank=0, world_size=1, master_port=0)
    asyncrpc.init(rank=0, world_size=1, master_port=0)


if __name__ == "__main__":
    try:
        globals()[f"case_{sys.argv[1]}"]()
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
        sys.exit(3)
