"""A one-worker world started where its registration folder may not be writable.

    python tests/programs/unwritable_registry.py twice   # two worlds in turn, in this process
    python tests/programs/unwritable_registry.py serve   # one world, until stdin closes

The registration only helps asyncrpc-dump find the world: the world must
start whatever the folders are, and say at most once per process that it
runs unregistered. Prints RAN after each world, READY while serving.
"""

import sys

import asyncrpc


def main() -> None:
    rounds = 2 if sys.argv[1] == "twice" else 1
    for _ in range(rounds):
        ctx = asyncrpc.init(rank=0, world_size=1, master_port=0)
        assert asyncrpc.rpc_sync(ctx.name, int, args=("7",)) == 7
        if sys.argv[1] == "serve":
            print("READY", flush=True)
            sys.stdin.read()
        asyncrpc.shutdown()
        print("RAN", flush=True)


if __name__ == "__main__":
    main()
