"""The ports of three Ray programs (examples/from_ray/) run as a user runs them.

Each prints its results (checked here: the serving fleet's sizes follow
its rule, the policy and the parameter server learn), none is longer than
its Ray original in benchmarks/from_ray/ (non-blank lines), and under the
torch they were recorded with they print the numbers the Ray originals
printed under Ray 2.60. benchmarks/from_ray.py runs the ports without Ray.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

from conftest import ROOT, run_program

PROGRAMS = ("actor_pool", "parameter_server", "serving")

# What the Ray originals printed (Ray 2.60, torch 2.13.0, 2 CPUs); the ports print the same.
RAY_PRINTED = {
    "actor_pool": """\
iteration 0: mean reward 0.2441, loss +0.0163
iteration 1: mean reward 0.2861, loss -0.0245
iteration 2: mean reward 0.2988, loss -0.0535
iteration 3: mean reward 0.3379, loss -0.0915
iteration 4: mean reward 0.3506, loss -0.1267
iteration 5: mean reward 0.4072, loss -0.1564
iteration 6: mean reward 0.4375, loss -0.1779
iteration 7: mean reward 0.4746, loss -0.2067
iteration 8: mean reward 0.5127, loss -0.2319
iteration 9: mean reward 0.5410, loss -0.2341""",
    "parameter_server": """\
Running synchronous parameter server training.
Iter 0: accuracy is 10.5, loss 2.4134
Iter 10: accuracy is 30.2, loss 2.1153
Iter 20: accuracy is 50.7, loss 1.9289
Iter 30: accuracy is 78.4, loss 1.6883
Iter 39: accuracy is 86.7, loss 1.4448""",
    "serving": """\
tick 0:  4 requests, 1 replica(s)
tick 1: 32 requests, 4 replica(s)
tick 2: 24 requests, 4 replica(s)
tick 3:  0 requests, 3 replica(s)
tick 4:  0 requests, 2 replica(s)
tick 5: 16 requests, 2 replica(s)
tick 6:  0 requests, 1 replica(s)
tick 7:  0 requests, 1 replica(s)
76 requests served: classes [0, 1, 73, 2], mean top score 0.3764""",
}
RECORDED_UNDER = "2.13."


def _port(name: str) -> Path:
    return ROOT / "examples" / "from_ray" / f"{name}.py"


def _numbers(line: str) -> list[float]:
    return [float(n) for n in re.findall(r"[-+]?\d+\.\d+", line)]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """benchmarks/from_ray.py as a module (its `compare`, `count_lines`, `paths`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))
        patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # what importing ray_peer sets
        script = ROOT / "benchmarks" / "from_ray.py"
        spec = importlib.util.spec_from_file_location("from_ray", script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", PROGRAMS)
def test_each_port_is_no_longer_than_its_ray_original(name: str, bench: ModuleType) -> None:
    files = bench.paths(name)
    assert files["asyncrpc"] == _port(name)
    ours, theirs = bench.count_lines(files["asyncrpc"]), bench.count_lines(files["ray"])
    assert ours <= theirs, f"{name}: the port has {ours} non-blank lines, Ray's {theirs}"


def test_printed_results_compare_equal_close_or_differ(bench: ModuleType) -> None:
    ref = ["Iter 0: accuracy is 10.5, loss 2.4134"]
    assert bench.compare(ref, list(ref)) == ("equal", 0.0)
    verdict, worst = bench.compare(ref, ["Iter 0: accuracy is 10.5, loss 2.4135"])
    assert verdict == "close" and worst == pytest.approx(1 / 24135, rel=1e-3)
    assert bench.compare(ref, ["Iter 0: accuracy is 12.5, loss 2.4134"])[0] == "DIFFER"
    assert bench.compare(ref, ["Iter 0: accuracy was 10.5, loss 2.4134"]) == ("DIFFER", None)
    assert bench.compare(ref, [*ref, "one line more"]) == ("DIFFER", None)


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", PROGRAMS)
def test_each_port_runs_as_a_user_runs_it_and_prints_its_results(name: str) -> None:
    result = run_program("python", str(_port(name)), timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    expected = RAY_PRINTED[name].splitlines()
    assert len(lines) == len(expected), result.stdout
    if name == "actor_pool":
        rewards = [_numbers(line)[0] for line in lines]
        assert rewards[-1] > rewards[0] + 0.1, result.stdout  # the policy learns
    elif name == "parameter_server":
        accuracy, loss = zip(*(_numbers(line) for line in lines[1:]), strict=True)
        assert accuracy[-1] > 60 and loss[-1] < loss[0], result.stdout
    else:  # the fleet grows with each burst's backlog and shrinks at each idle tick
        assert lines[:-1] == expected[:-1], result.stdout
        assert lines[-1].startswith("76 requests served: classes ["), result.stdout
    if torch.__version__.startswith(RECORDED_UNDER):
        assert lines == expected, f"{name} printed\n{result.stdout}\nRay's printed\n{expected}"


@pytest.mark.subprocess
@pytest.mark.timeout(240)
def test_the_benchmark_runs_the_ports_alone_without_ray(tmp_path: Path) -> None:
    out = tmp_path / "from_ray.json"
    script = ROOT / "benchmarks" / "from_ray.py"
    result = run_program(
        "python", str(script), "--rounds", "1", "--no-ray", "--json", str(out), timeout=200
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "Ray rows skipped: --no-ray; the ports run alone" in result.stdout, result.stdout
    for row in (
        "actor pool feeding a learner",
        "synchronous parameter server",
        "serving fleet scaling with load",
    ):
        line = next((ln for ln in result.stdout.splitlines() if ln.startswith(row)), None)
        assert line is not None, f"no {row!r} row in:\n{result.stdout}"
        assert re.search(r"\d+\.\d+ s +- +- +equal, Ray skipped", line), line
    found = json.loads(out.read_text())
    assert found["benchmark"] == "from_ray" and "ray" in found and found["rounds"] == 1, found
    for name in PROGRAMS:
        figures = found["programs"][name]
        assert isinstance(figures["seconds"]["asyncrpc"], float), figures
        assert figures["ray_over_ours"] is None and figures["results"] == "equal", figures
        assert figures["lines"]["asyncrpc"] <= figures["lines"]["ray"], figures
