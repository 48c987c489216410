"""Ray's serving fleet that scales with load, ported (Ray's: benchmarks/from_ray/serving_ray.py).

`Replica` objects, each on a worker of its own, serve the same small torch
model one request at a time (a sleep of `MODEL_S` stands for a larger
model's time). Requests arrive in bursts, one burst a tick. The driver
holds the backlog: when a burst arrives it grows the fleet to a replica per
`PER_REPLICA` queued requests, each on a worker it adds (`add_workers`),
then hands each free replica the next request, `asyncrpc.wait`ing for the
first to finish; at a tick without requests it removes an idle replica's
worker (`remove_workers`). It prints what Ray's version prints.

    python examples/from_ray/serving.py
"""

import time
from collections import deque

import torch
from torch import nn

import asyncrpc

BURSTS = [4, 32, 24, 0, 0, 16, 0, 0]  # requests arriving at each tick
PER_REPLICA = 8  # queued requests per replica
MAX_REPLICAS = 4
MODEL_S = 0.01  # a request's model time


def request(i):
    """The input of request i."""
    return torch.randn(1, 16, generator=torch.Generator().manual_seed(i))


class Replica:
    def __init__(self):
        torch.manual_seed(0)  # every replica serves the same model
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).eval()

    def predict(self, x):
        time.sleep(MODEL_S)
        with torch.no_grad():
            return torch.softmax(self.model(x), dim=1)


def main(ctx):
    if ctx.rank != 0:
        return  # the other workers hold the replicas and serve their calls
    replicas = [asyncrpc.spawn(None, Replica)]
    outputs = {}
    for tick, count in enumerate(BURSTS):
        queue = deque(range(len(outputs), len(outputs) + count))
        wanted = min(MAX_REPLICAS, -(-len(queue) // PER_REPLICA))
        while len(replicas) < wanted:  # a backlog: one replica more, on a new worker
            replicas.append(asyncrpc.spawn(asyncrpc.add_workers(1)[0], Replica))
        if not queue and len(replicas) > 1:
            asyncrpc.remove_workers(replicas.pop().owner, wait=False)  # idle: one replica fewer
        free, running = list(replicas), {}
        while queue or running:
            while free and queue:  # the next request to each free replica
                replica, i = free.pop(), queue.popleft()
                running[replica.call_async("predict", request(i))] = (i, replica)
            [done], _ = asyncrpc.wait(list(running), num_returns=1)
            i, replica = running.pop(done)
            outputs[i] = done.wait()
            free.append(replica)
        print(f"tick {tick}: {count:2d} requests, {len(replicas)} replica(s)")
    scores = torch.cat([outputs[i] for i in range(len(outputs))])
    classes = torch.bincount(scores.argmax(dim=1), minlength=4).tolist()
    print(f"{len(outputs)} requests served: classes {classes}, mean top score "
          f"{scores.max(dim=1).values.mean():.4f}")  # fmt: skip


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2, elastic=True, max_world_size=1 + MAX_REPLICAS)
