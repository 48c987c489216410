"""Ray's synchronous parameter server, ported (Ray's: benchmarks/from_ray/parameter_server_ray.py).

A `ParameterServer` object holds a small ConvNet and an SGD optimizer;
`DataWorker` objects each compute the gradient of one batch at the weights
they are given. Every iteration the driver passes the gradients' Futures
straight to `apply_gradients`, which sums them, steps once and returns the
new weights; every 10 iterations the driver evaluates them. Ray's classes
and loop, `call_async` for `.remote`: a Future passed arrives as its value,
sent by the worker that computed it. Same seeds: the same numbers as Ray's.

    python examples/from_ray/parameter_server.py
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import asyncrpc

ITERATIONS = 40
NUM_WORKERS = 2


def batches(seed, batch_size=64):
    """An endless stream of (images, labels): ten fixed prototypes under noise."""
    prototypes = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    while True:
        target = torch.randint(10, (batch_size,), generator=gen)
        yield prototypes[target] + torch.randn(batch_size, 1, 28, 28, generator=gen), target


def evaluate(model, data, target):
    """Accuracy (%) and mean loss on a held-out batch."""
    with torch.no_grad():
        output = model(data)
    accuracy = 100.0 * (output.argmax(dim=1) == target).float().mean().item()
    return accuracy, F.nll_loss(output, target).item()


class ConvNet(nn.Module):
    """Small ConvNet for 28x28 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3)
        self.fc = nn.Linear(192, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 3))
        return F.log_softmax(self.fc(x.view(-1, 192)), dim=1)

    def get_weights(self):
        return {k: v.cpu() for k, v in self.state_dict().items()}

    def set_weights(self, weights):
        self.load_state_dict(weights)

    def get_gradients(self):
        return [None if p.grad is None else p.grad.data.cpu().numpy() for p in self.parameters()]

    def set_gradients(self, gradients):
        for g, p in zip(gradients, self.parameters(), strict=True):
            if g is not None:
                p.grad = torch.from_numpy(g)


class ParameterServer:
    def __init__(self, lr):
        torch.manual_seed(0)
        self.model = ConvNet()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def apply_gradients(self, *gradients):
        summed = [np.stack(grads).sum(axis=0) for grads in zip(*gradients, strict=True)]
        self.optimizer.zero_grad()
        self.model.set_gradients(summed)
        self.optimizer.step()
        return self.model.get_weights()

    def get_weights(self):
        return self.model.get_weights()


class DataWorker:
    def __init__(self, seed):
        self.model = ConvNet()
        self.data_iterator = batches(seed)

    def compute_gradients(self, weights):
        self.model.set_weights(weights)
        data, target = next(self.data_iterator)
        self.model.zero_grad()
        F.nll_loss(self.model(data), target).backward()
        return self.model.get_gradients()


def main(ctx):
    if ctx.rank != 0:
        return  # the other workers hold the actors and serve their calls
    ps = asyncrpc.spawn(None, ParameterServer, 1e-2)
    workers = [asyncrpc.spawn(None, DataWorker, seed) for seed in range(NUM_WORKERS)]
    model = ConvNet()
    test_data, test_target = next(batches(seed=1000, batch_size=1024))

    print("Running synchronous parameter server training.")
    current_weights = ps.call_async("get_weights")
    for i in range(ITERATIONS):
        gradients = [worker.call_async("compute_gradients", current_weights) for worker in workers]
        # Calculate the update once every gradient is available.
        current_weights = ps.call_async("apply_gradients", *gradients)
        if i % 10 == 0 or i == ITERATIONS - 1:  # evaluate the current model
            model.set_weights(current_weights.wait())
            accuracy, loss = evaluate(model, test_data, test_target)
            print(f"Iter {i}: accuracy is {accuracy:.1f}, loss {loss:.4f}")


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2 + NUM_WORKERS)
