"""PyTorch's own async_execution tests pass with asyncrpc's decorator substituted.

Each of torch's tests starts a fresh 4-process world (~10 s), so the suite
here runs a few forms (raise, wrong return, chained, static method, RRef
proxy to a class method, TorchScript); tests/torch_suite/run_async_tests.py
with no arguments runs all 37 of them.
"""

import re

import pytest

from conftest import ROOT, run_program

SCRIPT = str(ROOT / "tests" / "torch_suite" / "run_async_tests.py")
SUBSET = [
    "test_async_function_raise_remote",
    "test_async_function_wrong_return_type_async",
    "test_async_function_chained_remote",
    "test_async_static_method_remote",
    "test_async_class_rref_proxy_async",
    "test_async_script_udf",
]


@pytest.mark.subprocess
@pytest.mark.timeout(400)
def test_torch_async_execution_tests_pass_with_our_decorator() -> None:
    pytest.importorskip("expecttest", reason="torch's test helpers need expecttest")
    argv = [arg for name in SUBSET for arg in ("-k", name)]
    result = run_program("python", SCRIPT, *argv, timeout=380)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-4000:]
    assert "async_execution under test: asyncrpc._execution" in report
    ran = re.search(r"Ran (\d+) tests", report)
    assert ran and int(ran.group(1)) >= len(SUBSET), report[-2000:]
    assert re.search(r"^OK", report, re.MULTILINE), report[-2000:]
