"""One worker of an `init` world whose peer the test kills before the shutdown.

    python tests/programs/dead_peer_shutdown.py RANK PORT

Rank 1 prints READY and waits to be killed. Rank 0 prints READY, waits for a
line on stdin (the peer is dead by then), leaves through `with asyncrpc.init`
and prints what the shutdown raised and how long it took.
"""

import sys
import time

import asyncrpc

if __name__ == "__main__":
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    try:
        with asyncrpc.init(rank=rank, world_size=2, master_port=port) as ctx:
            print("READY", flush=True)
            if rank == 1:
                time.sleep(300)
            sys.stdin.readline()
            started = time.monotonic()
    except asyncrpc.WorkerUnreachableError as error:
        took = time.monotonic() - started
        print(f"RAISED {type(error).__name__} name={error.name} after {took:.1f} s: {error}")
        sys.exit(0)
    print("RETURNED")
