"""The bad-input catalogue: each mistake gets a clear error, and the world keeps working.

Every case checks the error's type and the words that say what to do, then
makes a normal call to show that nothing was left broken. World formation
cases that need several processes (world size mismatch, duplicate names) are
in test_runtime.py; a killed worker is in test_world.py and test_remote.py.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import tempfile
import threading
from collections.abc import Callable

import pytest
import torch

import asyncrpc
from asyncrpc import rpc_async, rpc_sync

from conftest import PROGRAMS, run_program


def ident(x: object) -> object:
    return x


def give_lock() -> threading.Lock:
    return threading.Lock()


@asyncrpc.async_execution
def returns_a_number(x: int) -> int:
    return x  # not a Future


@asyncrpc.async_execution
async def awaits_a_number(x: int) -> int:
    return await x  # type: ignore[misc]


def raise_worker_only(folder: str) -> None:
    with open(os.path.join(folder, "worker_only_plugin.py"), "w") as f:
        f.write("class PluginError(Exception):\n    pass\n")
    sys.path.insert(0, folder)
    raise importlib.import_module("worker_only_plugin").PluginError("the plugin failed")


def recurse(depth: int, to: str) -> int:
    """Blocking nested calls into the same worker: each holds one of its RPC threads."""
    return 0 if depth == 0 else rpc_sync(to, recurse, args=(depth - 1, to)) + 1


class Adder:
    @asyncrpc.async_execution  # the order torch's decorator refuses
    @staticmethod
    def add(to: str, x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        return rpc_async(to, torch.add, args=(x, 1))


def _still_works() -> None:
    assert rpc_sync("worker1", ident, args=(41,)) == 41


def _raises(error: type[BaseException], pattern: str, call: Callable[[], object]) -> None:
    with pytest.raises(error, match=pattern):
        call()
    _still_works()


def test_non_future_return_from_an_async_function(world: asyncrpc.Context) -> None:
    # torch re-raises remote errors of non-builtin types as RuntimeError, named.
    _raises(
        RuntimeError,
        r"NotAFutureError.*returned int 1; return rpc_async",
        lambda: rpc_sync("worker1", returns_a_number, args=(1,)),
    )


def test_unpicklable_argument(world: asyncrpc.Context) -> None:
    _raises(
        asyncrpc.SerializationError,
        r"could not be sent to 'worker1': cannot pickle.*asyncrpc.spawn",
        lambda: rpc_sync("worker1", ident, args=(threading.Lock(),)),
    )
    _raises(
        asyncrpc.SerializationError,
        "cannot pickle",
        lambda: rpc_async("worker1", ident, args=(threading.Lock(),)),
    )


def test_unpicklable_result(world: asyncrpc.Context) -> None:
    _raises(
        asyncrpc.SerializationError,
        r"result of give_lock\(\) on 'worker1'.*could not be sent back",
        lambda: rpc_sync("worker1", give_lock),
    )


def test_unknown_worker_name(world: asyncrpc.Context) -> None:
    call = lambda: rpc_sync("wrker1", ident)  # noqa: E731
    _raises(asyncrpc.UnknownWorkerError, "did you mean 'worker1'", call)


def test_callable_called_instead_of_passed(world: asyncrpc.Context) -> None:
    _raises(
        TypeError,
        r"got a Tensor where a callable was expected; pass the function itself",
        lambda: rpc_async("worker1", torch.neg(torch.ones(1))),  # type: ignore[arg-type]
    )


def test_exception_inside_a_chained_callback(world: asyncrpc.Context) -> None:
    def lookup(value: object) -> object:
        return {}["missing"]

    fut = asyncrpc.chain(rpc_async("worker1", ident, args=(1,)), lookup, str)
    _raises(KeyError, "missing", fut.wait)


def test_awaiting_a_non_future(world: asyncrpc.Context) -> None:
    _raises(
        TypeError,
        r"int.*can't be used in 'await' expression",
        lambda: rpc_sync("worker1", awaits_a_number, args=(5,)),
    )


@pytest.mark.parametrize("timeout", [-1.5, math.inf, math.nan])
def test_negative_or_non_finite_timeout(world: asyncrpc.Context, timeout: float) -> None:
    _raises(ValueError, "timeout", lambda: rpc_sync("worker1", ident, args=(1,), timeout=timeout))


def test_remote_exception_whose_class_the_caller_cannot_import(world: asyncrpc.Context) -> None:
    with tempfile.TemporaryDirectory() as folder:
        _raises(
            asyncrpc.SerializationError,
            r"worker_only_plugin.PluginError was raised, but this process cannot rebuild it"
            r".*importable",
            lambda: rpc_sync("worker1", raise_worker_only, args=(folder,)),
        )


def test_recursion_through_nested_blocking_calls_fails_fast(world: asyncrpc.Context) -> None:
    assert rpc_sync("worker1", recurse, args=(3, "worker1")) == 3  # shallow is fine
    # 40 levels would hold more than worker1's 16 RPC threads: refused, not a stall.
    _raises(
        RuntimeError,
        r"NestedCallError.*last free RPC thread.*async_execution",
        lambda: rpc_sync("worker1", recurse, args=(40, "worker1"), timeout=20),
    )


def test_decorator_order_torch_refuses_works_here(world: asyncrpc.Context) -> None:
    got = rpc_sync("worker1", Adder.add, args=("worker2", torch.ones(2)))
    assert got.tolist() == [2.0, 2.0]
    _still_works()


def test_large_message_goes_through(world: asyncrpc.Context) -> None:
    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB
    assert rpc_sync("worker1", ident, args=(big,)).sum().item() == big.numel()
    _still_works()


@pytest.mark.parametrize(
    ("case", "patterns"),
    [
        ("port_in_use", [r"PortInUseError: port \d+ on 127.0.0.1 is already in use"]),
        (
            "before_init",
            [
                r"NotInitializedError: .*asyncrpc.run|NotInitializedError: .*init",
                r"asyncrpc\.rpc_sync was called but no RPC agent runs in this process",
            ],
        ),
        (
            "after_shutdown",
            [
                r"NotInitializedError: .*called after asyncrpc.shutdown",
                r"NotInitializedError: asyncrpc\.rpc_async was called after",
            ],
        ),
    ],
)
def test_use_and_calls_outside_a_world(case: str, patterns: list[str]) -> None:
    done = run_program("python", str(PROGRAMS / "misuse.py"), case, timeout=60)
    assert done.returncode == 3, done.stderr
    for pattern in patterns:
        assert __import__("re").search(pattern, done.stdout), (pattern, done.stdout)


def test_fanout_member_called_instead_of_passed() -> None:
    with pytest.raises(TypeError, match="not the result of calling it"):
        asyncrpc.Fanout([torch.neg(torch.ones(1))])  # type: ignore[list-item]


def test_ensemble_given_a_module_instead_of_its_class() -> None:
    with pytest.raises(TypeError, match=r"pass the class itself"):
        asyncrpc.Ensemble(torch.nn.Linear(2, 2), 2)  # type: ignore[arg-type]
