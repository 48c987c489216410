"""Each RPC thread keeps one Python thread state (and so its thread-locals) between calls.

Without it (torch's own behaviour, `keep_thread_states=False`) pybind11 makes a
new state each time a thread of torch's pool takes the GIL: thread-locals set
by one call are gone at the next call on the same thread.
"""

from __future__ import annotations

import threading
import time

import pytest

import asyncrpc
from asyncrpc._core import _threadstates

from conftest import PROGRAMS, run_program

_local = threading.local()


def remember() -> tuple[int, int]:
    """This thread's ident and how many calls it had seen (a thread-local count)."""
    seen = getattr(_local, "seen", 0)
    _local.seen = seen + 1
    return threading.get_ident(), seen


def _kept_soon(worker: str, threads: int) -> int:
    """How many RPC threads of `worker` hold a kept state, once its start has kept them."""
    deadline = time.monotonic() + 10
    # A peer may call a worker before its start has given every thread a state.
    while (kept := asyncrpc.rpc_sync(worker, _threadstates.kept)) < threads:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return kept


def test_every_rpc_thread_keeps_its_state_between_calls(world: asyncrpc.Context) -> None:
    threads = 16  # the session world's num_worker_threads
    assert _kept_soon("worker1", threads) == threads
    assert _kept_soon("worker2", threads) == threads
    seen_before: dict[int, int] = {}
    for _ in range(3 * threads):
        ident, seen = asyncrpc.rpc_sync("worker2", remember)
        assert seen == seen_before.get(ident, seen), f"thread {ident} forgot its calls"
        seen_before[ident] = seen + 1
    assert max(seen_before.values()) >= 2  # threads were called again, and remembered


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_keep_thread_states_false_gives_torchs_own_behaviour() -> None:
    result = run_program("python", str(PROGRAMS / "thread_states.py"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for world in ("kept", "not-kept"):
        calls = [
            tuple(map(int, line.split()[1:]))
            for line in result.stdout.splitlines()
            if line.split()[0] == world
        ]
        assert len(calls) == 24, result.stdout
        counts: dict[int, int] = {}
        for ident, seen in calls:
            assert seen == (counts.get(ident, 0) if world == "kept" else 0), (world, calls)
            counts[ident] = counts.get(ident, 0) + 1
        assert max(counts.values()) >= 2, calls  # 24 calls on 4 threads: some thread ran again


def test_keep_thread_states_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="keep_thread_states must be True or False, got 'yes'"):
        asyncrpc.Settings(keep_thread_states="yes")  # type: ignore[arg-type]
