"""PyTorch's own RPC tests, with their calls made through asyncrpc's verbs.

torch ships its RPC test suite inside the wheel
(torch/testing/_internal/distributed/rpc/rpc_test.py). Its test module calls
`rpc.rpc_sync`, `rpc.rpc_async` and `rpc.remote` through the name `rpc`; this
script gives that module an `rpc` whose three verbs are asyncrpc's (every
other name is torch's), then runs the tests named on the command line, or by
default every test of those calls and of RRefs on the TensorPipe agent. It
prints how many ran and passed.

    python tests/torch_suite/run_call_tests.py              # the default selection
    python tests/torch_suite/run_call_tests.py -k py_udf    # any other subset
"""

from __future__ import annotations

import os
import pathlib
import sys
import types

# torch's runner writes JUnit XML through the optional `xmlrunner` package
# whenever CI is set; we only want its exit status.
os.environ.pop("CI", None)

import torch.distributed.rpc as rpc
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.rpc import rpc_test
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import generate_tests

import asyncrpc


class _RpcThroughAsyncrpc(types.ModuleType):
    """torch.distributed.rpc, with rpc_sync / rpc_async / remote taken from asyncrpc."""

    rpc_sync = staticmethod(asyncrpc.rpc_sync)
    rpc_async = staticmethod(asyncrpc.rpc_async)
    remote = staticmethod(asyncrpc.remote)

    def __getattr__(self, name: str) -> object:
        return getattr(rpc, name)


rpc_test.rpc = _RpcThroughAsyncrpc("torch.distributed.rpc")

# Tests of rpc_sync / rpc_async / remote with Python functions, builtins,
# nested calls and RRefs, selected by name. Those of async functions run with
# our decorator in run_async_tests.py; here they would repeat the same calls.
DEFAULT_PATTERNS = [
    "test_py_",
    "test_nested_",
    "test_multi_",
    "test_self_",
    "test_rref_",
    "test_builtin_",
    "test_remote_",
    "test_rpc_timeouts",
    "test_add",
    "test_stress",
    "test_return_",
    "test_user_rrefs",
    "test_pickle_",
    "test_wait_all",
    "test_send_to_rank",
    "test_custom_exception_throw_during_reconstruction",
]


class UvFixture(TensorPipeRpcAgentTestFixture):
    """torch's TensorPipe fixture on the uv transport.

    The default shared-memory transport busy-polls a core per worker, and
    torch's tests run four workers: on a small machine each test then takes
    several times longer. The calls under test are the same.
    """

    @property
    def rpc_backend_options(self) -> rpc.TensorPipeRpcBackendOptions:
        return rpc.backend_registry.construct_rpc_backend_options(  # type: ignore[no-any-return]
            self.rpc_backend, init_method=self.init_method, _transports=["uv"]
        )


globals().update(generate_tests("TensorPipe", UvFixture, [rpc_test.RpcTest], __name__))


def selected() -> list[str]:
    """The names of the tests the default run selects."""
    names = [n for n in dir(TensorPipeRpcTest) if n.startswith("test_")]  # noqa: F821
    return [n for n in names if n.startswith(tuple(DEFAULT_PATTERNS)) and "async_" not in n]


def substituted() -> bool:
    """True when torch's test module calls asyncrpc's verbs."""
    return rpc_test.rpc.rpc_sync is asyncrpc.rpc_sync and rpc_test.rpc.remote is asyncrpc.remote


def _defined_in(function: object) -> str:
    """The asyncrpc source file that defines ``function``, e.g. asyncrpc/_core/_calls.py."""
    path = pathlib.Path(function.__code__.co_filename)  # type: ignore[attr-defined]
    return "/".join(path.parts[-3:])


if __name__ == "__main__":
    if not substituted():
        sys.exit("torch's RPC test module does not call asyncrpc; nothing was tested")
    print("rpc verbs under test:", _defined_in(asyncrpc.rpc_sync), flush=True)
    if "-k" not in sys.argv:
        for name in selected():
            sys.argv += ["-k", name]
    run_tests()
