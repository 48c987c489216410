"""asyncrpc.trace: one Chrome/Perfetto trace for the world; render_trace draws it."""

from __future__ import annotations

import json
import pathlib
import time
from collections import Counter
from typing import Any

import pytest
import torch

import asyncrpc
from asyncrpc._core import _calls
from asyncrpc._trace import _render, _timeline, _trace

from conftest import ROOT, run_program

pytestmark = [pytest.mark.usefixtures("world"), pytest.mark.xdist_group("trace")]  # one trace


def work(n: int) -> torch.Tensor:
    return torch.mm(torch.rand(n, n), torch.rand(n, n)).sum()


def nested(n: int) -> torch.Tensor:
    return asyncrpc.rpc_sync("worker2", work, args=(n,)) + 1


@asyncrpc.async_execution
async def awaits(n: int) -> torch.Tensor:
    return (await asyncrpc.rpc_async("worker2", work, args=(n,))) * 2


@torch.jit.script
def scripted_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def load(path: pathlib.Path) -> list[dict[str, Any]]:
    document = json.loads(path.read_text())
    assert isinstance(document, dict) and isinstance(document["traceEvents"], list)
    events: list[dict[str, Any]] = document["traceEvents"]
    return events


def ours(events: list[dict[str, Any]], kind: str) -> dict[int, dict[str, Any]]:
    return {
        e["args"]["call"]: e
        for e in events
        if e.get("cat") == "asyncrpc" and e["ph"] == "X" and e["args"]["kind"] == kind
    }


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """worker0 -> worker1 -> worker2 (blocking and awaited), and 3 calls in flight at once."""
    path = tmp_path_factory.mktemp("trace") / "calls.json"
    with asyncrpc.trace(path) as trace:
        asyncrpc.rpc_sync("worker1", nested, args=(150,))
        in_flight = [asyncrpc.rpc_async("worker1", work, args=(100,)) for _ in range(3)]
        asyncrpc.rpc_sync("worker1", awaits, args=(80,))
        asyncrpc.gather(in_flight).wait()
    assert trace.workers == ("worker0", "worker1", "worker2")
    assert trace.path == path and trace.events
    return load(path)


def test_the_merged_file_is_trace_json_with_one_process_per_worker(
    traced: list[dict[str, Any]],
) -> None:
    names = {e["pid"]: e["args"]["name"] for e in traced if e["name"] == "process_name"}
    assert sorted(names.values()) == ["worker0", "worker1", "worker2"]
    assert Counter(e["name"] for e in traced if e["ph"] == "M")["process_name"] == 3
    assert {e["pid"] for e in traced} == set(names)  # nothing outside the worker tracks
    assert {e["ph"] for e in traced} <= {"X", "i", "I", "M", "s", "f"}
    timed = [e for e in traced if e["ph"] != "M"]
    assert min(e["ts"] for e in timed) == 0 and all(e["ts"] >= 0 for e in timed)
    threads = {(e["pid"], e["args"]["name"]) for e in traced if e["name"] == "thread_name"}
    worker1 = names and next(p for p, n in names.items() if n == "worker1")
    assert (worker1, "calls in") in threads and (worker1, "calls out") in threads
    assert any(e["name"] == "aten::mm" and e["pid"] == worker1 for e in traced)


def test_a_callee_span_lies_inside_its_caller_span(traced: list[dict[str, Any]]) -> None:
    calls, runs = ours(traced, "call"), ours(traced, "run")
    # nested: 0->1 and 1->2; awaits: 0->1 and 1->2; three plain 0->1 calls.
    assert len(calls) == len(runs) == 7, (sorted(calls), sorted(runs))
    for ident, call in calls.items():
        run = runs[ident]
        assert call["ts"] <= run["ts"], (call, run)
        assert run["ts"] + run["dur"] <= call["ts"] + call["dur"], (call, run)
    by_name = {run["name"]: run for run in runs.values()}
    assert by_name["nested() <- worker0"]["args"]["thread"] > 0
    deferred = [run for run in runs.values() if run["name"].startswith("awaits()")]
    assert len(deferred) == 1
    # The awaited call's run on worker2 lies inside the async function's span.
    inner = next(
        runs[c]
        for c, call in calls.items()
        if call["pid"] == deferred[0]["pid"]
        and call["ts"] >= deferred[0]["ts"]
        and call["ts"] <= deferred[0]["ts"] + deferred[0]["dur"]
    )
    assert inner["ts"] + inner["dur"] <= deferred[0]["ts"] + deferred[0]["dur"]


def test_every_call_has_a_flow_from_its_caller_to_its_callee(
    traced: list[dict[str, Any]],
) -> None:
    calls, runs = ours(traced, "call"), ours(traced, "run")
    flows: dict[int, dict[str, dict[str, Any]]] = {}
    for e in traced:
        if e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], {})[e["ph"]] = e
    assert set(flows) == set(calls)
    for ident, pair in flows.items():
        start, finish = pair["s"], pair["f"]
        assert (start["pid"], start["tid"], start["ts"]) == tuple(
            calls[ident][k] for k in ("pid", "tid", "ts")
        )
        assert (finish["pid"], finish["tid"], finish["ts"]) == tuple(
            runs[ident][k] for k in ("pid", "tid", "ts")
        )
        assert finish["bp"] == "e" and start["cat"] == finish["cat"] == "asyncrpc"


class Slow(torch.nn.Module):
    """A member that takes long enough for the pool's threads to share the work."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x + 1


def summed_first(refs: list[asyncrpc.ObjectRef[torch.Tensor]]) -> float:
    return float(asyncrpc.get(refs[0]).sum())


def test_a_fetch_of_an_object_shows_on_the_worker_that_fetched_it(
    tmp_path: pathlib.Path,
) -> None:
    ref = asyncrpc.put(torch.ones(1000))
    with asyncrpc.trace(tmp_path / "fetch.json"):
        assert asyncrpc.rpc_sync("worker2", summed_first, args=([ref],)) == 1000.0
    events = load(tmp_path / "fetch.json")
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    fetches = [e for e in events if e["name"].startswith("fetch ObjectRef")]
    assert fetches and {names[e["pid"]] for e in fetches} == {"worker2"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}  # fmt: skip
    assert "asyncrpc-fetch" in threads[fetches[0]["pid"], fetches[0]["tid"]]


def test_members_on_threads_show_on_threads_of_their_worker(tmp_path: pathlib.Path) -> None:
    members = [Slow() for _ in range(2)]
    ensemble = asyncrpc.Ensemble(Slow, 4, workers=["worker1"], engine="threads", threads=2)
    with torch.no_grad(), asyncrpc.trace(tmp_path / "t.json"):
        asyncrpc.fanout(members, torch.ones(8, 64), engine="threads", threads=2)
        ensemble(torch.ones(8, 64))
    events = load(tmp_path / "t.json")
    pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    for worker in ("worker0", "worker1"):
        spans = [e for e in events if e["name"].startswith("member ") and e["pid"] == pids[worker]]
        assert len({e["tid"] for e in spans}) >= 2, (worker, spans)


def test_the_fork_engine_and_torchscript_calls_are_traced(tmp_path: pathlib.Path) -> None:
    members = [torch.jit.script(torch.nn.Linear(32, 32)) for _ in range(2)]
    with torch.no_grad(), asyncrpc.trace(tmp_path / "t.json"):
        asyncrpc.fanout(members, torch.ones(4, 32), engine="fork")
        y = asyncrpc.rpc_sync("worker1", scripted_add, args=(torch.ones(2), torch.ones(2)))
    assert y.tolist() == [2.0, 2.0]
    events = load(tmp_path / "t.json")
    assert sum(e["name"] == "aten::linear" for e in events) >= 2
    # TorchScript functions are called by name: the caller's span, no flow.
    script_calls = [c for c in ours(events, "call").values() if "scripted_add" in c["name"]]
    assert [c["args"]["call"] for c in script_calls] == [0]
    assert not [e for e in events if e["ph"] == "s"]


def test_a_trace_is_written_even_when_the_body_raises(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ZeroDivisionError), asyncrpc.trace(tmp_path / "t.json"):
        asyncrpc.rpc_sync("worker1", work, args=(10,))
        1 / 0  # noqa: B018
    assert ours(load(tmp_path / "t.json"), "run")
    with asyncrpc.trace(tmp_path / "again.json"):  # every worker stopped recording
        pass


def test_bad_arguments_fail_before_anything_records(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such folder"):
        with asyncrpc.trace(tmp_path / "missing" / "t.json"):
            pass
    with pytest.raises(ValueError, match=r"\['worker9'\] are not in this world"):
        with asyncrpc.trace(tmp_path / "t.json", workers=["worker9"]):
            pass
    with pytest.raises(TypeError, match="a list of names"):
        with asyncrpc.trace(tmp_path / "t.json", workers="worker1"):
            pass
    with asyncrpc.trace(tmp_path / "t.json", workers=["worker2"]) as trace:
        with pytest.raises(asyncrpc.AsyncRPCError, match="already recording"):
            with asyncrpc.trace(tmp_path / "u.json"):
                pass
    assert trace.workers == ("worker0", "worker2")


def test_a_worker_that_cannot_start_leaves_the_others_stopped(tmp_path: pathlib.Path) -> None:
    asyncrpc.rpc_sync("worker1", _trace._begin, args=("stray",))
    try:
        with pytest.raises(Exception, match="already recording a trace"):
            with asyncrpc.trace(tmp_path / "t.json"):
                pass
        assert not _trace.recording()
        with asyncrpc.trace(tmp_path / "t.json", workers=["worker2"]) as trace:
            asyncrpc.rpc_sync("worker2", work, args=(10,))
        assert ours(trace.events, "run")
    finally:
        asyncrpc.rpc_sync("worker1", _trace._finish, args=("stray",))


def test_a_recording_left_open_stops_when_its_world_ends() -> None:
    # What the world's end runs for this part (_runtime.end -> close): the profiler
    # stops, and calls go out untraced again; a second close does nothing.
    state = _trace._Recording()
    recorder = state.recorder = _trace._Recorder("left-open")
    recorder.start()
    hooked: list[str] = []

    def hook(to: str, fn: Any) -> tuple[Any, None]:
        hooked.append(to)
        return fn, None

    _calls.set_outgoing_hook(hook)
    state.close()
    state.close()
    assert state.recorder is None and not recorder._thread.is_alive()
    asyncrpc.rpc_sync("worker1", work, args=(2,))
    assert hooked == []


def test_untraced_calls_send_the_function_itself() -> None:
    assert _trace.outgoing("worker1", work) == (work, None)


def test_clock_offsets_are_estimated_between_hosts() -> None:
    # Same boot id: one clock. Different: estimated from round trips (same clock here).
    assert _trace._clock_offset("worker1", "a", "a") == 0
    assert abs(_trace._clock_offset("worker1", "a", "b")) < 5_000_000  # ns


def test_render_draws_a_png(traced: list[dict[str, Any]], tmp_path: pathlib.Path) -> None:
    import matplotlib.image

    source = tmp_path / "t.json"
    source.write_text(json.dumps({"traceEvents": traced}))
    _render.main([str(source), str(tmp_path / "t.png"), "--title", "calls"])
    picture = matplotlib.image.imread(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.shape[0] > 200 and picture.std() > 0.05  # not a blank image


def test_render_rejects_what_is_not_a_trace(tmp_path: pathlib.Path) -> None:
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        asyncrpc.render_trace(tmp_path / "x.json", tmp_path / "x.png")
    (tmp_path / "e.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="no spans"):
        asyncrpc.render_trace(tmp_path / "e.json", tmp_path / "e.png")


@pytest.mark.subprocess
@pytest.mark.timeout(150)  # past run_program's own: a stuck run shows its stacks
def test_the_traced_ensemble_example_writes_the_trace_and_the_picture(
    tmp_path: pathlib.Path,
) -> None:
    example = str(ROOT / "examples" / "trace_ensemble.py")
    result = run_program("python", example, "--out", str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "events from worker0, worker1, worker2" in result.stdout
    events = load(tmp_path / "trace_ensemble.json")
    pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    for worker in ("worker1", "worker2"):  # two members side by side on each
        threads = {
            e["tid"] for e in events if e["pid"] == pids[worker] and e["name"].startswith("member")
        }
        assert len(threads) == 2, (worker, threads)
    assert (tmp_path / "trace_ensemble.png").stat().st_size > 10_000


@pytest.mark.subprocess
@pytest.mark.timeout(150)  # past run_program's own: a stuck run shows its stacks
def test_the_trace_overhead_benchmark_runs_at_a_small_size() -> None:
    script = str(ROOT / "benchmarks" / "trace_overhead.py")
    result = run_program("python", script, "--calls", "30", "--rounds", "1", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.endswith("x")]
    assert [row.split()[0] for row in rows] == ["rpc_sync", "BiLSTM"], result.stdout


def test_cuda_work_lies_on_the_worker_that_ran_it_a_lane_per_device_and_stream() -> None:
    # torch's trace as its profiler writes it with ProfilerActivity.CUDA: kernels and
    # copies on a pseudo-process per GPU (pid = device), the launch on the worker's.
    trace = {"baseTimeNanoseconds": 0, "traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 41, "tid": 41,
         "ts": 10.0, "dur": 2.0},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 11.0,
         "dur": 5.0, "args": {"device": 0, "stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 1, "tid": 13,
         "ts": 12.0, "dur": 1.0, "args": {"device": 1, "stream": 13}},
        {"ph": "X", "cat": "cpu_op", "name": "other process", "pid": 99, "tid": 1, "ts": 9.0,
         "dur": 1.0},
    ]}  # fmt: skip
    part = {"pid": 41, "trace": json.dumps(trace), "spans": [], "threads": {}}
    events = _timeline.merge(["worker0"], {"worker0": part}, {})
    timed = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(timed) == {"cudaLaunchKernel", "gemm", "Memcpy HtoD"}
    assert {e["pid"] for e in timed.values()} == {1}  # worker0's process
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"cuda:0 stream 7", "cuda:1 stream 13"} <= lanes
