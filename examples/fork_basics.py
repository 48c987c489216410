"""fork/wait basics, the TorchScript way and with asyncrpc's fan-out.

    python examples/fork_basics.py

`torch.jit.fork` runs in parallel only inside TorchScript; `asyncrpc.fanout`
gives the same results for eager code (threads) or scriptable modules (fork).
TorchScript is deprecated (torch 2.13 says so with a DeprecationWarning, 2.14
and later with a FutureWarning); this example reproduces the reference
tutorial's TorchScript as it is, so it silences that one warning.
"""

import warnings

import torch
from torch import Tensor

import asyncrpc

warnings.filterwarnings("ignore", message=r".*torch\.jit.*deprecated")


def foo(x: Tensor) -> Tensor:
    return torch.neg(x)


@torch.jit.script
def one_fork(x: Tensor) -> tuple[Tensor, Tensor]:
    future = torch.jit.fork(foo, x)  # runs while the next line runs
    x_normal = foo(x)
    return x_normal, torch.jit.wait(future)


@torch.jit.script
def hundred_forks(x: Tensor) -> Tensor:
    futures: list[torch.jit.Future[Tensor]] = []
    for _ in range(100):
        futures.append(torch.jit.fork(foo, x))
    return torch.sum(torch.stack([torch.jit.wait(f) for f in futures]))


class AddMod(torch.nn.Module):
    def forward(self, a: Tensor, b: int) -> Tensor:
        return a + b


class Mod(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mod = AddMod()

    def forward(self, a: Tensor) -> Tensor:
        future = torch.jit.fork(self.mod, a, b=2)  # a module, with a keyword argument
        return torch.jit.wait(future)


def main() -> None:
    x = torch.ones(1)
    print("one fork:", one_fork(x))
    print("100 forks summed:", hundred_forks(torch.ones([])))
    print("module fork with b=2:", torch.jit.script(Mod())(torch.tensor(2)))

    print("fanout, one member:", asyncrpc.fanout([foo, foo], x))
    print("fanout, 100 members summed:", sum(asyncrpc.fanout([foo] * 100, torch.ones([]))))
    print("fanout, module with b=2:", asyncrpc.fanout([AddMod()], torch.tensor(2), b=2))


if __name__ == "__main__":
    main()
