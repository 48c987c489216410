"""Async remote functions: torch's reference flows, then the same flows as `async def`.

worker0 calls worker1, which makes a nested call to worker2 and returns
without holding a thread while it waits.

    python examples/async_execution.py
"""

import torch
from torch import Tensor
from torch.futures import Future

import asyncrpc
from asyncrpc import rpc_async

# ---- 1. chained add: a Future from then() ------------------------------------------


@asyncrpc.async_execution
def add_chained(to: str, x: Tensor, y: int, z: int) -> Future[Tensor]:
    return rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@asyncrpc.async_execution
async def add_chained_awaiting(to: str, x: Tensor, y: int, z: int) -> Tensor:
    return await rpc_async(to, torch.add, args=(x, y)) + z


# ---- 2. TorchScript: the decorator goes outermost ------------------------------------


@torch.jit.script
def script_add(x: Tensor, y: Tensor) -> Tensor:
    return x + y


@asyncrpc.async_execution
@torch.jit.script
def script_async_add(to: str, x: Tensor, y: Tensor) -> Future[Tensor]:
    return torch.distributed.rpc.rpc_async(to, script_add, (x, y))


@asyncrpc.async_execution
async def script_add_awaiting(to: str, x: Tensor, y: Tensor) -> Tensor:
    return await rpc_async(to, script_add, args=(x, y))


# ---- 3. static, class and bound methods ------------------------------------------------


class AsyncAdder:
    @staticmethod
    @asyncrpc.async_execution
    def static_add(to: str, x: Tensor, y: int, z: int) -> Future[Tensor]:
        return rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @asyncrpc.async_execution
    def class_add(cls, to: str, x: Tensor, y: int, z: int) -> Future[Tensor]:
        out: Future[Tensor] = Future()
        rpc_async(to, torch.add, args=(x, y)).then(lambda fut: out.set_result(fut.wait() + z))
        return out

    @asyncrpc.async_execution
    def bound_add(self, to: str, x: Tensor, y: int, z: int) -> Future[Tensor]:
        return rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    # The same three as `async def`; either decorator order works.
    @asyncrpc.async_execution
    @staticmethod
    async def static_await(to: str, x: Tensor, y: int, z: int) -> Tensor:
        return await rpc_async(to, torch.add, args=(x, y)) + z

    @asyncrpc.async_execution
    @classmethod
    async def class_await(cls, to: str, x: Tensor, y: int, z: int) -> Tensor:
        return await rpc_async(to, torch.add, args=(x, y)) + z

    @asyncrpc.async_execution
    async def bound_await(self, to: str, x: Tensor, y: int, z: int) -> Tensor:
        return await rpc_async(to, torch.add, args=(x, y)) + z


def show(label: str, value: Tensor) -> None:
    print(f"{label:<44} {value}")


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    ones = torch.ones(2)
    show(
        "chained add, then():",
        asyncrpc.rpc_sync("worker1", add_chained, args=("worker2", ones, 1, 1)),
    )
    show(
        "chained add, async def:",
        asyncrpc.rpc_sync("worker1", add_chained_awaiting, args=("worker2", ones, 1, 1)),
    )
    show(
        "TorchScript add:",
        asyncrpc.rpc_sync("worker1", script_async_add, args=("worker2", ones, ones)),
    )
    show(
        "TorchScript add, async def:",
        asyncrpc.rpc_sync("worker1", script_add_awaiting, args=("worker2", ones, ones)),
    )

    args = ("worker2", ones, 1, 2)
    for name in ("static_add", "class_add", "static_await", "class_await"):
        method = getattr(AsyncAdder, name)
        show(f"AsyncAdder.{name}, rpc_sync:", asyncrpc.rpc_sync("worker1", method, args=args))
        show(
            f"AsyncAdder.{name}, rpc_async:",
            asyncrpc.rpc_async("worker1", method, args=args).wait(),
        )

    rref = asyncrpc.remote("worker1", AsyncAdder)  # an AsyncAdder living on worker1
    for name in (
        "static_add",
        "class_add",
        "bound_add",
        "static_await",
        "class_await",
        "bound_await",
    ):
        show(f"rref.rpc_sync().{name}:", getattr(rref.rpc_sync(), name)(*args))
        show(f"rref.rpc_async().{name}:", getattr(rref.rpc_async(), name)(*args).wait())
        show(f"rref.remote().{name}.to_here():", getattr(rref.remote(), name)(*args).to_here())


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3)
