"""init/shutdown/Context: the world as a worker sees it, and world-formation errors."""

import datetime
import sys
import threading
import time

import pytest
import torch.distributed as dist

import asyncrpc
from asyncrpc._core import _context, _rendezvous

from conftest import PROGRAMS, ROOT, free_port, run_program


def test_context_describes_the_world(world: asyncrpc.Context) -> None:
    assert (world.rank, world.world_size, world.name) == (0, 3, "worker0")
    assert world.names == ("worker0", "worker1", "worker2")
    assert world.role is None
    assert asyncrpc.current_context() is world


def test_remote_workers_see_their_own_context(world: asyncrpc.Context) -> None:
    ctx = asyncrpc.rpc_sync("worker2", asyncrpc.current_context)
    assert (ctx.name, ctx.rank, ctx.names) == ("worker2", 2, world.names)


def test_names_from_roles() -> None:
    assert _context.names_for(3, None) == ("worker0", "worker1", "worker2")
    assert _context.names_for(3, {"ps": 1, "trainer": 2}) == ("ps0", "trainer0", "trainer1")
    with pytest.raises(asyncrpc.WorldSizeMismatchError, match="add up to 3 workers but"):
        _context.names_for(4, {"ps": 1, "trainer": 2})
    with pytest.raises(ValueError, match="positive count"):
        _context.names_for(1, {"ps": 0})


def test_context_roles() -> None:
    ctx = asyncrpc.Context(
        1, 3, "trainer0", ("ps0", "trainer0", "trainer1"), (("ps", 1), ("trainer", 2))
    )
    assert ctx.role == "trainer"
    assert ctx.workers("trainer") == ("trainer0", "trainer1")
    assert ctx.workers() == ctx.names
    with pytest.raises(LookupError, match="unknown role 'critic'"):
        ctx.workers("critic")


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"num_worker_threads": 0}, "num_worker_threads must be a positive int"),
        ({"rpc_timeout": float("nan")}, "rpc_timeout must be a finite"),
        ({"intra_op_threads": -1}, "intra_op_threads must be a positive int"),
        ({"heartbeat_timeout": 0}, r"heartbeat_timeout must be a finite number of seconds > 0"),
        ({"hang_report_after": True}, r"hang_report_after must be .* got True"),
        ({"hang_report_after": -1}, r"hang_report_after must be .* got -1"),
    ],
)
def test_bad_settings(options: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        asyncrpc.Settings(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["-5", "nan", "0", "soon"])
def test_a_bad_hang_report_environment_variable_is_refused(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncrpc._core import _world

    monkeypatch.setenv("ASYNCRPC_HANG_REPORT_AFTER", raw)
    with pytest.raises(ValueError, match=f"ASYNCRPC_HANG_REPORT_AFTER='{raw}' is not a number"):
        _world._hang_after_from_env()


def test_unknown_option_lists_the_known_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['rpc_timout'\].*rpc_timeout"):
        asyncrpc.Settings.from_options({"rpc_timout": 3})


def test_init_twice_in_one_process(world: asyncrpc.Context) -> None:
    with pytest.raises(asyncrpc.AsyncRPCError, match="already runs RPC as 'worker0'"):
        asyncrpc.init(rank=0, world_size=1, master_port=0)


def test_init_needs_a_rank_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="needs rank="):
        asyncrpc.init(world_size=2)
    with pytest.raises(ValueError, match="needs world_size="):
        asyncrpc.init(rank=0)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        asyncrpc.init(rank=2, world_size=2, master_port=1)
    with pytest.raises(ValueError, match="needs master_port"):
        asyncrpc.init(rank=1, world_size=2)


def test_program_world_size_must_match_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(asyncrpc.WorldSizeMismatchError, match=r"WORLD_SIZE=4.*--nproc-per-node 3"):
        asyncrpc.init(rank=0, world_size=3, master_port=0)


def _start_manual(*worlds: tuple[int, int, int, str | None]) -> list:  # type: ignore[type-arg]
    import subprocess
    import sys

    from conftest import ROOT

    procs = []
    for rank, size, port, name in worlds:
        argv = [sys.executable, str(PROGRAMS / "manual.py"), str(rank), str(size), str(port)]
        procs.append(
            subprocess.Popen(
                argv + ([name] if name else []),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return [(p.wait(60), *p.communicate()) for p in procs]


@pytest.mark.timeout(120)
def test_self_managed_processes_form_a_world() -> None:
    port = free_port()
    results = _start_manual((0, 2, port, None), (1, 2, port, None))
    assert [code for code, _, _ in results] == [0, 0], results
    assert results[0][1].strip() == "['worker0', 'worker1']"


@pytest.mark.timeout(120)
def test_duplicate_names_are_refused_on_every_worker() -> None:
    port = free_port()
    results = _start_manual((0, 2, port, "twin"), (1, 2, port, "twin"))
    for code, _, err in results:
        assert code == 3
        assert "DuplicateNameError" in err and "{'twin': [0, 1]}" in err


@pytest.mark.parametrize(("size0", "size1"), [(2, 3), (3, 2)])
@pytest.mark.timeout(120)
def test_workers_disagreeing_on_world_size(size0: int, size1: int) -> None:
    # (3, 2): rank 0 expects a rank 2 that never comes; rank 1's size names the
    # mistake while rank 0 waits, long before init_timeout.
    port = free_port()
    started = time.monotonic()
    results = _start_manual((0, size0, port, None), (1, size1, port, None))
    assert time.monotonic() - started < 15, results
    for rank, (code, _, err) in enumerate(results):
        assert code == 3, results
        assert "WorldSizeMismatchError" in err, err
        assert f"world_size={(size0, size1)[rank]}" in err, err


class _HeldStore(dist.Store):
    """A real store client whose reads wait at a gate: a worker slow to read its verdict."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.reading, self.gate = inner, threading.Event(), threading.Event()

    def get(self, key: str) -> bytes:
        self.reading.set()  # joined: its claim, name and size are in the store
        self.gate.wait(30)
        return self.inner.get(key)  # type: ignore[no-any-return]

    def set(self, key: str, value: str) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)  # type: ignore[no-any-return]

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)  # type: ignore[no-any-return]

    def append(self, key: str, value: str) -> None:
        self.inner.append(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.reading.set()
        self.gate.wait(30)
        return self.inner.multi_get(keys)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("host_size", "own_size", "error"),
    [(2, 2, asyncrpc.DuplicateNameError), (2, 3, asyncrpc.WorldSizeMismatchError)],
)
@pytest.mark.timeout(120)
def test_a_refusing_host_waits_until_a_slow_peer_has_read_the_verdict(
    host_size: int, own_size: int, error: type[Exception]
) -> None:
    # The unlucky order, forced: rank 0 (hosting the store) reaches its verdict while
    # rank 1 has joined but not yet read anything. Rank 0 must not take the store away.
    import subprocess

    port = free_port()
    host = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "manual.py"), "0", str(host_size), str(port), "twin"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )
        held = _HeldStore(client)
        outcome: list[BaseException] = []

        def rank1() -> None:
            try:
                _rendezvous.agree(held, 1, own_size, "twin", timeout=20)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=rank1)
        thread.start()
        # Rank 0 has everything it needs once rank 1 has joined; give it time to leave.
        assert held.reading.wait(30)
        time.sleep(1.0)
        assert host.poll() is None, "rank 0 left while rank 1 was still reading: " + str(
            host.communicate()
        )
        held.gate.set()
        thread.join(30)
        code, (_, err) = host.wait(60), host.communicate()
    finally:
        if host.poll() is None:
            host.kill()
    assert len(outcome) == 1 and isinstance(outcome[0], error), outcome
    assert code == 3 and error.__name__ in err, err


@pytest.mark.parametrize(
    ("case", "pattern"),
    [  # a port in use: tests/test_faults.py
        ("init_twice", "AsyncRPCError: this process already runs RPC as 'worker0'"),
    ],
)
def test_world_formation_errors(case: str, pattern: str) -> None:
    done = run_program("python", str(PROGRAMS / "misuse.py"), case, timeout=60)
    assert done.returncode == 3, done.stderr
    assert __import__("re").search(pattern, done.stdout), done.stdout


def test_a_size_mismatch_names_only_the_ranks_that_disagree() -> None:
    from asyncrpc._core import _rendezvous

    with pytest.raises(asyncrpc.WorldSizeMismatchError) as raised:
        _rendezvous._check_sizes(1, {0: 3, 1: 3, 2: 4}, 3)
    assert "this one (rank 1) has world_size=3, but rank(s) report {2: 4};" in str(raised.value)
