"""PyTorch's own RPC tests for async_execution, with asyncrpc.async_execution substituted.

torch ships its RPC test suite inside the wheel
(torch/testing/_internal/distributed/rpc/). This script replaces
`torch.distributed.rpc.functions.async_execution` with ours *before* those
modules are imported, so every function they decorate uses asyncrpc's
decorator, then runs the tests whose names mention async functions,
async execution or RRef proxies on the TensorPipe agent.

    python tests/torch_suite/run_async_tests.py          # the async subset
    python tests/torch_suite/run_async_tests.py -k rref  # any other subset
"""

import os
import pathlib
import sys

# torch's runner writes JUnit XML through the optional `xmlrunner` package
# whenever CI is set; we only want its exit status.
os.environ.pop("CI", None)

import torch.distributed.rpc as rpc

import asyncrpc

rpc.functions.async_execution = asyncrpc.async_execution

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.rpc import rpc_test  # noqa: E402
from torch.testing._internal.distributed.rpc.jit.rpc_test import JitRpcTest  # noqa: E402
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (  # noqa: E402
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import generate_tests  # noqa: E402

# Selected by name; the default picks every test of an async function or RRef proxy.
DEFAULT_PATTERNS = ["async_function", "async_static", "async_class", "async_script", "async_add"]

SUITES = [rpc_test.RpcTest, JitRpcTest]
globals().update(generate_tests("TensorPipe", TensorPipeRpcAgentTestFixture, SUITES, __name__))


def substituted() -> bool:
    """True when torch's test functions were decorated by asyncrpc's decorator."""
    return rpc_test.async_add.__code__.co_filename == asyncrpc.async_execution.__code__.co_filename


def _defined_in(function: object) -> str:
    """The asyncrpc source file that defines ``function``, e.g. asyncrpc/_core/_calls.py."""
    path = pathlib.Path(function.__code__.co_filename)  # type: ignore[attr-defined]
    return "/".join(path.parts[-3:])


if __name__ == "__main__":
    if not substituted():
        sys.exit("torch's RPC tests were imported before the substitution; nothing was tested")
    print("async_execution under test:", _defined_in(asyncrpc.async_execution), flush=True)
    if "-k" not in sys.argv:
        for pattern in DEFAULT_PATTERNS:
            sys.argv += ["-k", pattern]
    run_tests()
