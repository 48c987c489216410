"""PyTorch's own RPC tests pass with asyncrpc's decorator, or asyncrpc's calls, substituted.

Each of torch's tests starts a fresh 4-process world (~10 s), so the suite
here runs two of each (the suite's 10-minute budget): async functions
(chained, RRef proxy to a class method) with our decorator, and calls
(exceptions, timeouts) through our verbs. With no arguments,
tests/torch_suite/run_async_tests.py runs all 37 of the first kind and
tests/torch_suite/run_call_tests.py the default selection of the second.
"""

import re

import pytest

from conftest import ROOT, run_program

SCRIPT = str(ROOT / "tests" / "torch_suite" / "run_async_tests.py")
CALLS_SCRIPT = str(ROOT / "tests" / "torch_suite" / "run_call_tests.py")
SUBSET = [
    "test_async_function_chained_remote",
    "test_async_class_rref_proxy_async",
]


def _run_torch_tests(script: str, names: list[str], marker: str) -> None:
    pytest.importorskip("expecttest", reason="torch's test helpers need expecttest")
    argv = [arg for name in names for arg in ("-k", name)]
    result = run_program("python", script, *argv, timeout=380)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-4000:]
    assert marker in report
    ran = re.search(r"Ran (\d+) tests", report)
    assert ran and int(ran.group(1)) >= len(names), report[-2000:]
    assert re.search(r"^OK", report, re.MULTILINE), report[-2000:]


@pytest.mark.subprocess
@pytest.mark.timeout(400)
def test_torch_async_execution_tests_pass_with_our_decorator() -> None:
    _run_torch_tests(SCRIPT, SUBSET, "async_execution under test: asyncrpc/_core/_execution.py")


CALLS_SUBSET = [
    "test_py_raise_in_user_func_escaped_str",
    "test_rpc_timeouts",
]


@pytest.mark.subprocess
@pytest.mark.timeout(400)
def test_torch_rpc_tests_pass_with_our_calls() -> None:
    _run_torch_tests(CALLS_SCRIPT, CALLS_SUBSET, "rpc verbs under test: asyncrpc/_core/_calls.py")
