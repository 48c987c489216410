"""A serving fleet scaling with load, in Ray as its docs teach it (the port: examples/from_ray/).

`Replica` actors each serve the same small torch model, one request at a
time (a sleep of `MODEL_S` stands for a larger model's time). Requests
arrive in bursts, one burst a tick. The driver holds the backlog: when a
burst arrives it grows the fleet to a replica per `PER_REPLICA` queued
requests (at most `MAX_REPLICAS`), then hands each free replica the next
request, `ray.wait`ing for the first to finish, until the burst is served;
at a tick without requests it kills an idle replica (`ray.kill`). It prints
the fleet's size at each tick, then the predictions' classes and mean score
(in request order: the same each run).

    python benchmarks/from_ray/serving_ray.py   # needs Ray: pip install 'asyncrpc[bench]'
"""

import time
from collections import deque

import ray
import torch
from torch import nn

BURSTS = [4, 32, 24, 0, 0, 16, 0, 0]  # requests arriving at each tick
PER_REPLICA = 8  # queued requests per replica
MAX_REPLICAS = 4
MODEL_S = 0.01  # a request's model time


def request(i):
    """The input of request i."""
    return torch.randn(1, 16, generator=torch.Generator().manual_seed(i))


@ray.remote
class Replica:
    def __init__(self):
        torch.manual_seed(0)  # every replica serves the same model
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).eval()

    def predict(self, x):
        time.sleep(MODEL_S)
        with torch.no_grad():
            return torch.softmax(self.model(x), dim=1)


if __name__ == "__main__":
    ray.init()
    replicas = [Replica.remote()]
    outputs = {}
    for tick, count in enumerate(BURSTS):
        queue = deque(range(len(outputs), len(outputs) + count))
        wanted = min(MAX_REPLICAS, -(-len(queue) // PER_REPLICA))
        while len(replicas) < wanted:  # a backlog: one replica more
            replicas.append(Replica.remote())
        if not queue and len(replicas) > 1:
            ray.kill(replicas.pop())  # idle: one replica fewer
        free, running = list(replicas), {}
        while queue or running:
            while free and queue:  # the next request to each free replica
                replica, i = free.pop(), queue.popleft()
                running[replica.predict.remote(request(i))] = (i, replica)
            [done], _ = ray.wait(list(running), num_returns=1)
            i, replica = running.pop(done)
            outputs[i] = ray.get(done)
            free.append(replica)
        print(f"tick {tick}: {count:2d} requests, {len(replicas)} replica(s)")
    scores = torch.cat([outputs[i] for i in range(len(outputs))])
    classes = torch.bincount(scores.argmax(dim=1), minlength=4).tolist()
    print(f"{len(outputs)} requests served: classes {classes}, mean top score "
          f"{scores.max(dim=1).values.mean():.4f}")  # fmt: skip
    ray.shutdown()
