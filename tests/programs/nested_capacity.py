"""N concurrent nested calls into a callee that has only 4 RPC threads.

worker0 sends N calls to worker1 at once; each one awaits a call to worker2
(`async def`), so worker1 must not hold a thread per waiting call. Prints
"N calls, E errors, sum ok|sum wrong".
"""

import sys
import time

import asyncrpc


def slow_increment(x: int) -> int:
    time.sleep(0.002)
    return x + 1


@asyncrpc.async_execution
async def relay(to: str, x: int) -> int:
    return await asyncrpc.rpc_async(to, slow_increment, args=(x,))


def main(ctx: asyncrpc.Context, n: int) -> None:
    if ctx.rank != 0:
        return
    futs = [asyncrpc.rpc_async("worker1", relay, args=("worker2", i)) for i in range(n)]
    errors, total = 0, 0
    for fut in futs:
        try:
            total += fut.wait()
        except Exception as exc:  # counted and reported, not hidden
            errors += 1
            print("error:", str(exc).splitlines()[0], file=sys.stderr)
    ok = "ok" if total == sum(range(1, n + 1)) else "wrong"
    print(f"{n} calls, {errors} errors, sum {ok}")


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    asyncrpc.run(main, world_size=3, args=(count,), num_worker_threads=4, rpc_timeout=30)
