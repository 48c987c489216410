"""Importing asyncrpc changes nothing; shutdown puts back what init changed."""

import os

import torch

import asyncrpc

KEYS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")

if __name__ == "__main__":
    for key in KEYS:
        os.environ.pop(key, None)
    assert not hasattr(torch._C.Future, "__await__"), "import gave Futures an __await__"
    print("after import: no __await__")
    torch.set_num_threads(2)
    before = ({k: os.environ.get(k) for k in KEYS}, torch.get_num_threads())
    asyncrpc.init(rank=0, world_size=1, master_port=0, intra_op_threads=1)
    print(f"during: TP_SOCKET_IFNAME={os.environ.get('TP_SOCKET_IFNAME')}")
    assert torch.get_num_threads() == 1
    asyncrpc.shutdown()
    after = ({k: os.environ.get(k) for k in KEYS}, torch.get_num_threads())
    assert after == before, (before, after)
    print("after shutdown: environment and threads as before")
