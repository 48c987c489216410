"""`devices` and `device_maps`: what runs without a GPU (tests/gpu/ holds the rest).

The options are checked as they are made; the maps a world builds come from
what each worker published in its store; torch's options object gets them;
a CUDA tensor with no map is named. Without CUDA, asking for it fails at
once, saying what to do.
"""

from __future__ import annotations

import json
import mmap
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed import HashStore

import asyncrpc
from asyncrpc._core import _devices, _failures, _torch

from conftest import PROGRAMS, ROOT, run_program

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@pytest.mark.parametrize(
    ("devices", "device_maps", "says"),
    [
        ("gpu", None, "or 'cuda' for one per worker, or 'cpu' for none; got 'gpu'"),
        ("cuda:x", None, "got 'cuda:x'"),
        (["cuda:0", "cuda:0"], None, "lists a device twice"),
        ({"cuda:0"}, None, "got {'cuda:0'}"),
        (True, None, "got True"),
        ("cuda:-1", None, "got 'cuda:-1'"),
        (3.5, None, "got 3.5"),
        ({"worker1": "tpu"}, None, "got 'tpu'"),
        (None, {"worker1": "cuda:1"}, "device_maps must be torch's"),
        (None, [("worker1", {})], "device_maps must be torch's"),
        (None, {"worker1": {"cuda:0": "meta"}}, "device_maps name CUDA devices"),
        (None, {"w1": {"cuda:0": "cuda:1", 1: "cuda:1"}}, "is not one to one"),
        ({"worker1": "gpu"}, None, "devices['worker1']: devices name CUDA devices"),
    ],
)
def test_devices_of_a_wrong_shape_are_refused_saying_what_is_allowed(
    devices: object, device_maps: object, says: str
) -> None:
    with pytest.raises(asyncrpc.DeviceMapError) as caught:
        asyncrpc.Settings(devices=devices, device_maps=device_maps)  # type: ignore[arg-type]
    assert says in str(caught.value)
    assert isinstance(caught.value, ValueError)


@NO_CUDA
@pytest.mark.parametrize(
    ("devices", "device_maps"),
    [("cuda", None), ("cuda:0", None), ([0, 1], None), (None, {"w1": {"cuda:0": "cuda:0"}})],
)
def test_without_cuda_asking_for_it_fails_at_once(devices: object, device_maps: object) -> None:
    with pytest.raises(asyncrpc.DeviceMapError, match="torch here has none") as caught:
        asyncrpc.Settings(devices=devices, device_maps=device_maps)  # type: ignore[arg-type]
    assert "leave devices and device_maps out" in str(caught.value)


@NO_CUDA
def test_run_with_devices_cuda_fails_before_any_process_starts() -> None:
    start = time.monotonic()
    with pytest.raises(asyncrpc.DeviceMapError, match="is_available"):
        asyncrpc.run(print, world_size=2, devices="cuda")
    assert time.monotonic() - start < 2.0


def test_cpu_and_the_default_need_no_cuda() -> None:
    for devices in (None, "cpu", "cpu:0", [], ["cpu"], torch.device("cpu"), {"worker0": "cpu"},
                    {"learner": "cuda", 3: "cpu"}):  # fmt: skip
        assert asyncrpc.Settings(devices=devices).devices == devices
        wants = isinstance(devices, dict) and "learner" in devices
        assert _devices.wants_cuda(devices, None) is wants


def _context(name: str, names: tuple[str, ...]) -> asyncrpc.Context:
    return asyncrpc.Context(names.index(name), len(names), name, names)


def test_the_maps_pair_each_gpu_worker_with_every_other_gpu_worker() -> None:
    # What the exchange reads: worker0 on cuda:0, worker1 on CPU, worker2 on cuda:1.
    names = ("worker0", "worker1", "worker2")
    store = HashStore()
    for name, devices in zip(names, ("cuda:0", "", "cuda:1"), strict=True):
        store.set(name, devices)
    # Each maps to itself too: torch sends a call to its own name through its agent.
    assert _devices._maps("cuda:0", _context("worker0", names), store, 5) == {
        "worker0": {"cuda:0": "cuda:0"},
        "worker2": {"cuda:0": "cuda:1"},
    }
    assert _devices._maps("cuda:1", _context("worker2", names), store, 5) == {
        "worker0": {"cuda:1": "cuda:0"},
        "worker2": {"cuda:1": "cuda:1"},
    }


def test_the_maps_wait_for_every_peer_and_say_who_is_missing() -> None:
    store = HashStore()
    store.set("worker0", "cuda:0")
    names = ("worker0", "worker1")
    with pytest.raises(asyncrpc.RendezvousError, match=r"\['worker1'\] did not say their"):
        _devices._maps("cuda:0", _context("worker0", names), store, 0.2)


def test_a_worker_takes_its_own_entry_by_name_role_or_rank() -> None:
    ctx = asyncrpc.Context(2, 3, "actor1", ("learner0", "actor0", "actor1"),
                           roles=(("learner", 1), ("actor", 2)))  # fmt: skip
    assert _devices.own({"learner0": "cuda"}, ctx) == []
    assert _devices.own({"actor1": "cpu", "actor": "cuda:0"}, ctx) == []
    assert _devices.own({2: "cpu"}, ctx) == []
    with pytest.raises(asyncrpc.DeviceMapError, match=r"names \['learners'\], which is no"):
        _devices.own({"learners": "cuda"}, ctx)


@NO_CUDA
def test_run_refuses_a_worker_given_cuda_or_an_unknown_key_before_any_process() -> None:
    start = time.monotonic()
    with pytest.raises(asyncrpc.DeviceMapError, match="devices gives \\{'worker1': 'cuda'\\}"):
        asyncrpc.run(print, world_size=2, devices={"worker1": "cuda", "worker0": "cpu"})
    with pytest.raises(asyncrpc.DeviceMapError, match="the roles \\['learner', 'actor'\\]"):
        asyncrpc.run(print, roles={"learner": 1, "actor": 2}, devices={"learners": "cpu"})
    with pytest.raises(asyncrpc.DeviceMapError, match=r"maps to \['worker9'\], which is no"):
        _devices.check_embedded(None, {"worker9": {0: 0}}, ("worker0", "worker1"), [])
    assert time.monotonic() - start < 2.0


def test_torchs_options_get_the_maps_and_derive_the_devices_as_torch_does() -> None:
    options = _torch.backend_options(4, 30.0, "tcp://127.0.0.1:1", ("uv",), ("basic",),
                                     {"worker1": {"cuda:0": "cuda:1"}})  # fmt: skip
    assert options.device_maps == {"worker1": {torch.device("cuda:0"): torch.device("cuda:1")}}
    assert options.devices == []  # torch derives them from the maps and their inverses
    plain = _torch.backend_options(4, 30.0, "tcp://127.0.0.1:1", ("uv",), ("basic",))
    assert plain.devices == [] and plain.device_maps == {}


def test_maps_are_read_in_torchs_names_and_must_be_one_to_one() -> None:
    assert _devices.normal_maps({"w1": {0: 1, "cuda:2": torch.device("cuda:3")}, "w2": {}}) == {
        "w1": {"cuda:0": "cuda:1", "cuda:2": "cuda:3"}
    }
    with pytest.raises(asyncrpc.DeviceMapError, match=r"device_maps\['w1'\] is not one to one"):
        _devices.normal_maps({"w1": {0: "cuda:1", "cuda:0": "cuda:2"}})
    with pytest.raises(asyncrpc.DeviceMapError, match="maps move CUDA tensors only"):
        _devices.normal_maps({"w1": {"cpu": "cpu"}})


def _torch_text(fragment: bytes) -> str:
    """The message around `fragment` as torch's own library holds it (its C++ source)."""
    lib = pathlib.Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    with lib.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(fragment)
        assert at >= 0, f"torch {torch.__version__} no longer says {fragment!r}"
        start, end = data.rfind(b"\0", 0, at) + 1, data.find(b"\0", at)
        return data[start:end].decode()


def test_a_cuda_tensor_with_no_map_is_named_with_the_option_to_pass() -> None:
    text = _torch_text(b"only supports CPU tensors by default")
    unmapped = RuntimeError(text + "Request device mapping is not available for destination 1")
    assert _torch.failure_kind(unmapped) == "unmapped"
    named = _failures.name_failure(unmapped, "worker1", torch.add)
    assert isinstance(named, asyncrpc.DeviceMapError) and isinstance(named, RuntimeError)
    assert "devices='cuda'" in str(named) and "tensor.cpu()" in str(named)
    assert named.__cause__ is unmapped
    reply = RuntimeError("Response" + _torch_text(b" device mapping is not available for"))
    assert _torch.failure_kind(reply) == "unmapped"


def _program(scenario: str) -> dict[str, object]:
    done = run_program("python", str(PROGRAMS / "devices.py"), scenario, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    return dict(json.loads(lines[-1]))


def test_a_world_of_named_cpu_workers_exchanges_its_devices_and_runs() -> None:
    assert _program("cpu-workers") == {"sum": 4.0, "published": {"worker0": "", "worker1": ""}}


@NO_CUDA
def test_a_worker_given_cuda_on_a_machine_without_it_names_itself() -> None:
    # Under a launcher (init): the worker finds out as it starts, and names itself.
    ctx = asyncrpc.Context(1, 2, "worker1", ("worker0", "worker1"))
    with pytest.raises(asyncrpc.DeviceMapError, match="worker 'worker1' is given devices"):
        _devices.own({"worker1": "cuda"}, ctx)


def test_a_world_whose_members_change_refuses_cuda_before_it_starts() -> None:
    seen = _program("healing")
    assert seen["error"] == "DeviceMapError"
    assert "a world whose members change" in str(seen["message"])


def test_a_world_whose_members_change_runs_with_cpu_devices() -> None:
    assert _program("healing-cpu") == {"sum": 4.0, "published": {"worker0": "", "worker1": ""}}


@NO_CUDA
def test_the_launcher_refuses_devices_it_cannot_have_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncrpc._launch._cli", "--devices", "cuda",
         "--nproc-per-node", "2", "examples/ring.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "asyncrpc-launch: error: --devices cuda asks for CUDA, but torch here has none" in (
        done.stderr
    )
    assert "leave --devices out to run on CPU" in done.stderr


@pytest.mark.timeout(200)  # past run_program's own: a stuck run shows its stacks
def test_the_gpu_learner_example_runs_here_and_says_where_its_learner_is() -> None:
    done = run_program("python", "examples/gpu_learner.py", "--rounds", "20", timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert f"learner on {expected}; reward" in done.stdout
    assert "rose" in done.stdout.splitlines()[-1]
    fallback = "gpu_learner: no CUDA here, so the learner runs on CPU too"
    assert (fallback in done.stdout) is not torch.cuda.is_available()
