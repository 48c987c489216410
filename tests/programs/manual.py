"""One self-managed worker: init(rank=..., world_size=...) with values from argv.

argv: rank world_size port [name]. Rank 0 calls every other worker and prints replies.
"""

import sys

import asyncrpc


def hello() -> str:
    return asyncrpc.current_context().name


if __name__ == "__main__":
    rank, size, port = (int(a) for a in sys.argv[1:4])
    name = sys.argv[4] if len(sys.argv) > 4 else None
    try:
        with asyncrpc.init(
            rank=rank, world_size=size, master_port=port, name=name, init_timeout=20
        ) as ctx:
            if rank == 0:
                print(sorted(asyncrpc.rpc_sync(n, hello) for n in ctx.names))
    except asyncrpc.AsyncRPCError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(3)
