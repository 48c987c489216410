"""Heartbeats in the store: a worker that stops beating is named, one that left is not."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from asyncrpc._core._liveness import Liveness, report_exits

NAMES = ("worker0", "worker1", "worker2")


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)


def _watchers(store: dist.TCPStore, tag: str) -> tuple[list[Liveness], list[str], threading.Event]:
    records: list[str] = []
    seen = threading.Event()

    def on_failure(record: str) -> None:
        records.append(record)
        seen.set()

    lives = [
        Liveness(store, r, NAMES, tag, interval=0.05, timeout=0.6, on_failure=on_failure)
        for r in range(3)
    ]
    return lives, records, seen


def test_a_worker_that_stops_beating_is_named_within_the_timeout() -> None:
    lives, records, seen = _watchers(_store(), "a")
    for live in lives:
        live.start()
    time.sleep(0.3)
    lives[0].stop()  # left on purpose: never reported
    time.sleep(1.0)
    assert records == []
    stopped = time.monotonic()
    lives[2].stop(left=False)  # as if SIGKILLed
    assert seen.wait(5)
    took = time.monotonic() - stopped
    lives[1].stop()
    assert records[0].startswith("worker 'worker2' (rank 2, node ")
    assert "stopped beating" in records[0]
    assert 0.5 < took < 2.0, took


def test_a_reported_failure_reaches_every_watcher_first_report_wins() -> None:
    store = _store()
    lives, records, seen = _watchers(store, "b")
    for live in lives[1:]:
        live.start()
    first = lives[0].report("raised KeyError: 'shard'")
    report_exits(store, "b", [(0, 4242, -9)], elsewhere=[])  # the launcher comes second
    assert seen.wait(5)
    deadline = time.monotonic() + 5
    while len(records) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    for live in lives[1:]:
        live.stop()
    assert records == [first, first]
    assert first.startswith("worker 'worker0' (rank 0, node ")
    assert first.endswith("raised KeyError: 'shard'")


def test_the_reporting_launcher_waits_until_the_other_nodes_have_read_it() -> None:
    store = _store()
    lives, records, _ = _watchers(store, "c")
    for live in lives[1:]:  # rank 1 shares the launcher's node, rank 2 is elsewhere
        live.start()
    report_exits(store, "c", [(0, 4242, -9)], elsewhere=[2])
    space = dist.PrefixStore("asyncrpc/clive/", store)
    assert space.check(["seen/2"]), "the launcher ended before rank 2 read the report"
    for live in lives[1:]:
        live.stop()
    assert records and all(r.startswith("worker 'worker0' (rank 0") for r in records), records
    assert records[0].endswith("was killed by SIGKILL")
