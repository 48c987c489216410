"""Two 2-worker worlds, thread states kept then not: what worker1's RPC threads
remember between calls, one line per call: world, thread ident, calls it had seen."""

import threading

import asyncrpc

_local = threading.local()


def remember() -> tuple[int, int]:
    seen = getattr(_local, "seen", 0)
    _local.seen = seen + 1
    return threading.get_ident(), seen


def main(ctx: asyncrpc.Context, world: str) -> None:
    if ctx.rank == 0:
        for _ in range(24):
            ident, seen = asyncrpc.rpc_sync("worker1", remember)
            print(world, ident, seen, flush=True)


if __name__ == "__main__":
    for keep in (True, False):
        world = "kept" if keep else "not-kept"
        asyncrpc.run(
            main, world_size=2, args=(world,), num_worker_threads=4, keep_thread_states=keep
        )
