"""CUDA tensors through every verb, on a machine with a GPU (skipped without one).

One run of `gpu_world.py` (two worlds) records every check; each test here
reads one. `tests/gpu/run.sh` runs these and `benchmarks/gpu.py` together.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent.parent

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"needs CUDA (torch {torch.__version__} here has none); tests/gpu/run.sh runs these",
)

CHECKS = ("devices", "args_and_results", "handles", "rrefs", "batch", "streams", "cancel",
          "to_the_cpu_worker", "cpu_tensor_to_the_cpu_worker", "ensemble",
          "fanout_over_workers", "trace", "explicit_maps")  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu") / "checks.json"
    done = subprocess.run([sys.executable, str(HERE / "gpu_world.py"), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    found: dict[str, Any] = json.loads(out.read_text())
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], "gpu_checks.json").write_text(json.dumps(found, indent=1))
    return found


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", CHECKS)
def test_each_verb_carries_cuda_tensors(results: dict[str, Any], name: str) -> None:
    assert name in results, sorted(results)
    assert results[name]["ok"], results[name]


@pytest.mark.timeout(120)
def test_the_gpu_learner_example_puts_its_learner_on_the_gpu() -> None:
    done = subprocess.run([sys.executable, "examples/gpu_learner.py", "--rounds", "20"],
                          cwd=ROOT, capture_output=True, text=True, timeout=110)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "learner on cuda:0; reward" in done.stdout, done.stdout[-2000:]
