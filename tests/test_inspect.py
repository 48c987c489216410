"""Seeing inside running worlds: asyncrpc-dump, asyncrpc-top and hang reports, as users run them.

Each test starts real worlds in subprocesses with a runtime folder of its own
(XDG_RUNTIME_DIR) and a temporary folder of its own (TMPDIR, where a world
registers when the runtime folder cannot be written), so the commands find
exactly the worlds it started.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from asyncrpc._core import _registry

from conftest import PROGRAMS, ROOT, bin_path, run_program

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(150)]
HANG = str(ROOT / "examples" / "hang.py")
BUSY = str(PROGRAMS / "busy_world.py")
# Its call runs longer than any test: a world must outlive the commands a test runs in it,
# however loaded the machine (a 20-s call once ended before asyncrpc-top ran). Each
# test kills it.
BUSY_S = "600"


def short_tmp(runtime: pathlib.Path) -> pathlib.Path:
    """A TMPDIR of this test's own with a short path, the same for the same `runtime`.

    Not under pytest's temporary folder: its path grows with every run on a
    machine, and the forkserver's socket in TMPDIR must fit AF_UNIX's 107 bytes.
    """
    digest = hashlib.sha1(str(runtime).encode()).hexdigest()[:12]
    path = pathlib.Path(tempfile.gettempdir()) / f"asyncrpc-test-{digest}"
    path.mkdir(exist_ok=True)
    return path


def _env(runtime: pathlib.Path) -> dict[str, str]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "TMPDIR": str(short_tmp(runtime))}
    for key in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        env.pop(key, None)
    return env


def _start(argv: list[str], runtime: pathlib.Path) -> subprocess.Popen[str]:
    # A session of its own: the test ends the whole world at once (a world torch's
    # mp.spawn started has no asyncrpc supervisor to take its workers along).
    return subprocess.Popen(
        argv, cwd=ROOT, env=_env(runtime), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _command(name: str, runtime: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_path(name), *args], cwd=ROOT, env=_env(runtime), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def _timed_dump(runtime: pathlib.Path) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """`asyncrpc-dump --json`: its result, the seconds it took, and those its start-up took
    (its imports: torch's, mostly), as the command itself counts them."""
    said_start_up = (
        "import sys; from asyncrpc._inspect import _dump, _worlds; "
        "print(f'START-UP {_worlds._running_for()}', file=sys.stderr, flush=True); "
        "_dump.main(sys.argv[1:])"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", said_start_up, "--json"], cwd=ROOT, env=_env(runtime),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - started
    assert "START-UP " in done.stderr, done.stderr[-3000:]
    return done, took, float(done.stderr.split("START-UP ")[1].split()[0])


def _registered(runtime: pathlib.Path, workers: int, seconds: float = 60) -> dict[str, Any]:
    """The registrations of the one world in `runtime`, once `workers` have registered."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        worlds = _worlds_in(runtime)
        if worlds and len(next(iter(worlds.values()))) >= workers:
            return worlds
        time.sleep(0.1)
    raise AssertionError(f"{workers} workers never registered in {runtime}")


def _worlds_in(runtime: pathlib.Path) -> dict[str, list[dict[str, Any]]]:
    """`_registry.worlds()` as the commands see them with `_env(runtime)`."""
    env = _env(runtime)
    before = {key: os.environ.get(key) for key in ("XDG_RUNTIME_DIR", "TMPDIR")}
    os.environ.update({key: env[key] for key in before})
    try:
        return _registry.worlds()
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _popen(runtime: pathlib.Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env=_env(runtime),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _live_top(runtime: pathlib.Path) -> subprocess.Popen[str]:
    return _popen(runtime, bin_path("asyncrpc-top"), "--interval", "0.5")


def _says_the_world_ended(live: subprocess.Popen[str]) -> None:
    """The live view ends with the world: one line that says so, status 0, no traceback."""
    try:
        out, err = live.communicate(timeout=60)
    finally:
        live.kill()
    ended = [line for line in out.splitlines() if "the world ended" in line]
    assert live.returncode == 0 and len(ended) == 1, (live.returncode, out[-2000:], err[-3000:])
    assert "Traceback" not in err and "Error" not in err, err[-3000:]


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.communicate(timeout=30)


def test_a_deadlocked_world_is_dumped_with_its_cycle_and_reported(tmp_path: pathlib.Path) -> None:
    # The world never ends by itself: the calls' timeouts would be delivered by the very
    # RPC threads that are blocked. Its hang reports are read as they come, then it is killed.
    world = _start([sys.executable, HANG, "--report-after", "2"], tmp_path)
    reports = _Lines(world.stderr)
    try:
        worlds = _registered(tmp_path, 3)
        pids = {entry["name"]: entry["pid"] for entry in next(iter(worlds.values()))}
        time.sleep(1.5)  # worker2's calls reach f, g and the queue for h
        done, took, start_up = _timed_dump(tmp_path)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        text = _command("asyncrpc-dump", tmp_path)
        top = _command("asyncrpc-top", tmp_path, "--once", "--json")
        err = reports.wait_for("call to h() on worker0 still pending", "call to f() on worker0")
    finally:
        _stop(world)
    # Every RPC thread of worker0 and worker1 is blocked, and the dump still ends by its
    # rule: its answers are in by 4 s from its start (within 5 s in all), and however long
    # its start-up took on a loaded machine, its workers get at least 1 s to answer.
    assert took < max(4.0, start_up + 1.0) + 1.0, (took, start_up)
    workers = {w["name"]: w for w in result["workers"]}
    assert {name: w["pid"] for name, w in workers.items()} == pids
    f_calls = [c for c in workers["worker0"]["threads"] if c["call"] == "f()"]
    assert len(f_calls) == 2 and all(c["caller"] == "worker2" for c in f_calls)
    stack = f_calls[0]["stack"]
    assert any('examples/hang.py", line' in line and "in f" in line for line in stack), stack
    assert [c["to"] for c in workers["worker1"]["in_flight"]] == ["worker0", "worker0"]
    assert ["worker0", "worker1", "worker0"] in result["cycles"], result["cycles"]
    assert text.returncode == 0 and "cycle: worker0 f() -> worker1 g() -> worker0" in text.stdout
    assert "runs g() for worker0" in text.stdout and "hang.py" in text.stdout
    rows = {w["name"]: w for w in json.loads(top.stdout)["workers"]}
    assert rows["worker0"]["busy_threads"] == 2 == rows["worker0"]["total_threads"]
    assert rows["worker2"]["in_flight"] == 2 and rows["worker0"]["pid"] == pids["worker0"]
    # The hang reports the callers logged after 2 s: where the callee is, and the cycle.
    assert "call to f() on worker0 still pending after 2 s" in err, err[-3000:]
    assert "worker0 runs it at examples/hang.py:" in err and "in f (waits on worker1" in err
    assert "call to h() on worker0 still pending after 2 s: it has not started" in err
    assert "cycle: worker0 f() -> worker1 g() -> worker0" in err


class _Lines:
    """Collects a stream's lines on a thread; `wait_for` returns once all texts came."""

    def __init__(self, stream: Any) -> None:
        import threading

        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line)

    def wait_for(self, *texts: str, seconds: float = 60) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            joined = "".join(self.lines)
            if all(text in joined for text in texts):
                return joined
            time.sleep(0.1)
        return "".join(self.lines)


def test_the_commands_end_cleanly_while_a_thread_waits_on_a_store_that_died() -> None:
    program = str(PROGRAMS / "store_thread_exit.py")
    plain = run_program("python", program, "plain", timeout=60)  # what the commands avoid
    done = run_program("python", program, "run_command", timeout=60)
    assert done.returncode == 0 and done.stdout == "answered\n", (
        done.returncode, done.stderr[-3000:], "plain:", plain.returncode,
    )  # fmt: skip


def test_a_busy_worker_shows_in_top_and_its_stack_in_the_dump(tmp_path: pathlib.Path) -> None:
    world = _start([sys.executable, BUSY, BUSY_S], tmp_path)
    try:
        _registered(tmp_path, 2)
        assert world.stdout is not None and world.stdout.readline().startswith("BUSY")
        live = _live_top(tmp_path)
        top = _command("asyncrpc-top", tmp_path, "--once")  # its time: benchmarks/inspect_costs.py
        dump = json.loads(_command("asyncrpc-dump", tmp_path, "--json").stdout)
    finally:
        _stop(world)  # the world ends at once: killed
    _says_the_world_ended(live)
    assert top.returncode == 0, top.stderr
    header = top.stdout.splitlines()[1]
    for title in ("worker", "host", "pid", "RSS MB", "CPU %", "busy", "run", "out", "strm",
                  "fail", "p50 ms", "p99 ms", "objs", "obj MB"):  # fmt: skip
        assert title in header, header
    assert "busy: busy/total RPC threads" in top.stdout and "strm: open streams" in top.stdout
    worker0, worker1 = (next(line for line in top.stdout.splitlines() if line.startswith(name))
                        for name in ("worker0 ", "worker1 "))  # fmt: skip
    assert " 1/16 " in worker1, top.stdout
    # worker0 keeps the 1 MiB it put; worker1 holds what it fetched.
    assert worker0.split()[-2:] == ["1/0", "1.0"] and worker1.split()[-2:] == ["0/1", "1.0"]
    assert dump["workers"][1]["objects"] == {
        "kept": 0, "kept_bytes": 0, "fetched": 1, "fetched_bytes": 1 << 20
    }  # fmt: skip
    crunch = dump["workers"][1]["threads"][0]
    assert crunch["call"] == "crunch()" and crunch["caller"] == "worker0"
    assert any("busy_world.py" in line and "in crunch" in line for line in crunch["stack"])
    assert dump["cycles"] == []


def test_the_live_top_draws_a_table_a_terminal_shows(tmp_path: pathlib.Path) -> None:
    import pty

    world = _start([sys.executable, BUSY, BUSY_S], tmp_path)
    screen = b""
    try:
        _registered(tmp_path, 2)
        primary, secondary = pty.openpty()
        env = {**_env(tmp_path), "TERM": "xterm-256color", "COLUMNS": "80", "LINES": "40",
               "PYTHONFAULTHANDLER": "1"}  # fmt: skip  # SIGABRT: its stacks, if it hangs
        top = subprocess.Popen(
            [bin_path("asyncrpc-top"), "--interval", "0.5"], cwd=ROOT, env=env,
            stdin=secondary, stdout=secondary, stderr=secondary,
        )  # fmt: skip
        os.close(secondary)
        deadline = time.monotonic() + 30
        while screen.count(b"asyncrpc world") < 2 and time.monotonic() < deadline:
            try:
                screen += os.read(primary, 65536)  # redrawn in place, each interval
            except OSError:
                break
        top.send_signal(signal.SIGINT)  # Ctrl-C: leaves quietly
        after = _read_to_the_end(primary, within=30)  # as a terminal does: its writes go on
        if after is None:  # still running: its stacks, then the test fails
            top.send_signal(signal.SIGABRT)
            stacks = _read_to_the_end(primary, within=5) or b""
            shown = stacks.decode(errors="replace")[-6000:]
            raise AssertionError(f"asyncrpc-top ran on after Ctrl-C:\n{shown}")
        top.wait(30)
        os.close(primary)
    finally:
        _stop(world)
    text = screen.decode(errors="replace")
    assert text.count("asyncrpc world") >= 2, text[-2000:]
    # Every column whole in an 80-column terminal: names, and the last title.
    assert "worker0" in text and "worker1" in text and "p99 ms" in text, text[-2000:]
    assert "busy: busy/total RPC threads" in text
    assert "\x1b[" in text and "─" in text  # drawn by rich, in place, as a terminal shows it
    assert top.returncode == 0, after.decode(errors="replace")[-3000:]


def _read_to_the_end(primary: int, within: float) -> bytes | None:
    """What a terminal shows until its program exits; None if it runs on past `within` s."""
    import select

    shown, deadline = b"", time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([primary], [], [], left)[0]:
            break
        try:
            read = os.read(primary, 65536)
        except OSError:  # it has exited: its end of the terminal is closed
            return shown
        if not read:
            return shown
        shown += read
    return None


def test_the_commands_say_when_no_world_or_several_are_running(tmp_path: pathlib.Path) -> None:
    for command in ("asyncrpc-dump", "asyncrpc-top"):
        done = _command(command, tmp_path, *(["--once"] if command.endswith("top") else []))
        assert done.returncode == 1 and "no asyncrpc world is running" in done.stderr
    stale = {"address": "127.0.0.1:1", "prefix": "x", "rank": 0, "name": "w", "names": ["w"],
             "pid": 2**22 + 12345, "host": "h", "started": 0}  # fmt: skip
    # A live pid that another process now has (pids are reused): stale as well.
    reused = {**stale, "pid": os.getpid(), "process_started": 1}
    (tmp_path / "asyncrpc").mkdir(exist_ok=True)
    (tmp_path / "asyncrpc" / "127.0.0.1_1_0_1.json").write_text(json.dumps(stale))
    (tmp_path / "asyncrpc" / "127.0.0.1_1_0_2.json").write_text(json.dumps(reused))
    done = _command("asyncrpc-dump", tmp_path)
    assert done.returncode == 1 and "no asyncrpc world is running" in done.stderr  # stale
    assert not list((tmp_path / "asyncrpc").glob("*.json"))  # and removed
    worlds = [_start([sys.executable, BUSY, BUSY_S], tmp_path) for _ in range(2)]
    try:
        _registered_count(tmp_path, 2)
        done = _command("asyncrpc-dump", tmp_path)
        assert done.returncode == 2 and "2 worlds are running: pick one with --world" in (
            done.stderr
        )
        address = done.stderr.split("the worlds running:")[1].split()[0]
        picked = _command("asyncrpc-top", tmp_path, "--once", "--json", "--world", address)
    finally:
        for world in worlds:
            _stop(world)
    assert picked.returncode == 0 and json.loads(picked.stdout)["world"] == address


def test_a_worker_that_does_not_answer_is_listed_with_its_pid_and_every_key(
    tmp_path: pathlib.Path,
) -> None:
    from torch.distributed import TCPStore

    # A world's store whose one worker never answers (no watcher reads its requests).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    entry = {"address": f"127.0.0.1:{store.port}", "prefix": "asyncrpc/side/", "rank": 0,
             "name": "worker0", "names": ["worker0"], "pid": os.getpid(), "host": "here",
             "started": time.time(),
             "process_started": _registry.process_started(os.getpid())}  # fmt: skip
    (tmp_path / "asyncrpc").mkdir()
    (tmp_path / "asyncrpc" / f"127.0.0.1_{store.port}_0_{os.getpid()}.json").write_text(
        json.dumps(entry)
    )
    asks = (("asyncrpc-dump", ["--json"]), ("asyncrpc-top", ["--once", "--json"]))
    commands = [
        subprocess.Popen(
            [bin_path(name), *args],
            cwd=ROOT,
            env=_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in asks
    ]
    (dump, dump_err), (top, top_err) = (c.communicate(timeout=60) for c in commands)
    assert commands[0].returncode == 0 and commands[1].returncode == 0, dump_err + top_err
    silent = json.loads(dump)["workers"][0]
    assert silent["pid"] == os.getpid() and silent["error"].startswith("no answer within")
    assert silent["threads"] == [] and silent["in_flight"] == []
    row = json.loads(top)["workers"][0]
    keys = {"name", "host", "pid", "rss_mb", "cpu_percent", "busy_threads", "total_threads",
            "running", "in_flight", "streams", "failures"}  # fmt: skip
    assert keys <= set(row) and row["pid"] == os.getpid() and row["rss_mb"] is None


def _registered_count(runtime: pathlib.Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        worlds = _worlds_in(runtime)
        if len(worlds) == count and all(len(v) == 2 for v in worlds.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"{count} worlds never registered")


@pytest.mark.parametrize("how", ["torch", "asyncrpc-launch", "torchrun"])
def test_the_commands_work_in_every_kind_of_world(how: str, tmp_path: pathlib.Path) -> None:
    argv = {
        "torch": [sys.executable, BUSY, BUSY_S, "--torch"],
        "asyncrpc-launch": [bin_path("asyncrpc-launch"), "--nproc-per-node", "2", BUSY, BUSY_S],
        "torchrun": [bin_path("torchrun"), "--nproc-per-node", "2", BUSY, BUSY_S],
    }[how]
    world = _start(argv, tmp_path)
    try:
        _registered(tmp_path, 2)
        assert world.stdout is not None and world.stdout.readline().startswith("BUSY")
        live = _live_top(tmp_path)
        dump = _command("asyncrpc-dump", tmp_path, "--json")
        top = _command("asyncrpc-top", tmp_path, "--once", "--json")
    finally:
        _stop(world)  # the world ends at once, its store and launcher with it
    _says_the_world_ended(live)
    assert dump.returncode == 0, dump.stderr
    workers = json.loads(dump.stdout)["workers"]
    assert [w["name"] for w in workers] == ["worker0", "worker1"]
    crunch = workers[1]["threads"][0]
    assert crunch["call"] == "crunch()" and any("in crunch" in f for f in crunch["stack"])
    assert top.returncode == 0, top.stderr
    assert next(w["in_flight"] for w in json.loads(top.stdout)["workers"]) >= 1


def test_a_world_torch_ended_just_before_its_processes_exit_leaves_no_registration(
    tmp_path: pathlib.Path,
) -> None:
    # busy_world --torch ends with torch's own rpc.shutdown(), and each process returns
    # from mp.spawn's function at once: the exit guard ends the world before the watcher.
    world = _start([sys.executable, BUSY, "0.2", "--torch"], tmp_path)
    try:
        _registered(tmp_path, 2)
        out, err = world.communicate(timeout=90)
    finally:
        _stop(world)
    assert world.returncode == 0, err[-3000:]
    assert "done" in out
    assert sorted(p.name for p in (tmp_path / "asyncrpc").iterdir()) == []


def test_every_verb_reports_a_slow_call_once_and_a_quick_one_never() -> None:
    from conftest import run_program

    done = run_program("python", str(PROGRAMS / "hang_report.py"), timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [line for line in done.stderr.splitlines() if "still pending after" in line]
    where = {
        "slow_sync()": "in slow_sync",  # rpc_sync
        "slow_async()": "in slow_async",  # rpc_async
        "slow_remote()": "in slow_remote",  # remote
        "Slow.method()": "in method",  # a handle's call
        "slow_items()": "in slow_items",  # a stream
    }
    assert len(reports) == len(where), done.stderr[-3000:]  # quick calls log nothing
    for call, frame in where.items():
        line = next((r for r in reports if f"call to {call} on worker1" in r), None)
        assert line is not None, (call, reports)
        assert "still pending after 1 s: worker1 runs it at" in line, line
        assert "hang_report.py:" in line and line.endswith(frame), line


def test_hang_reports_in_a_world_torch_started_come_from_the_environment(
    tmp_path: pathlib.Path,
) -> None:
    env_runtime = tmp_path / "runtime"
    env_runtime.mkdir()
    world = subprocess.Popen(
        [sys.executable, BUSY, BUSY_S, "--torch"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**_env(env_runtime), "ASYNCRPC_HANG_REPORT_AFTER": "1"},
    )  # fmt: skip
    reports = _Lines(world.stderr)
    try:
        err = reports.wait_for("call to crunch() on worker1 still pending after 1 s")
    finally:
        _stop(world)
    assert "call to crunch() on worker1 still pending after 1 s: worker1 runs it at" in err
    assert "busy_world.py:" in err and "in crunch" in err


_ENTRY = {"asyncrpc-dump": "_dump", "asyncrpc-top": "_top"}


def _timed(runtime: pathlib.Path, *commands: list[str]) -> list[tuple[float, Any]]:
    """Run the commands at once: (seconds each took past its own start-up, its result).

    Each says how long its start-up (its imports: torch's, mostly) took, as the
    command itself counts it, so a loaded machine's slow imports do not count.
    """
    started = time.monotonic()
    procs = []
    for name, *args in commands:
        said = (
            f"import sys; from asyncrpc._inspect import {_ENTRY[name]}, _worlds; "
            "print(f'START-UP {_worlds._running_for()}', file=sys.stderr, flush=True); "
            f"sys.exit({_ENTRY[name]}.main(sys.argv[1:]))"
        )
        procs.append(_popen(runtime, sys.executable, "-c", said, *args))
    timed = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - started
        assert "START-UP " in err, err[-3000:]
        start_up = float(err.split("START-UP ")[1].split()[0])
        err = err.split("\n", 1)[1] if err.startswith("START-UP ") else err
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        timed.append((took - start_up, done))
    return timed


def test_a_stopped_store_host_or_worker_is_named_within_the_bound(tmp_path: pathlib.Path) -> None:
    from asyncrpc._inspect._worlds import store_holder

    # A world torch started: no heartbeats, so a stopped process is not taken for a dead
    # one. Its store is worker0's. A stopped process still takes connections (the kernel
    # queues them) and never answers.
    world = _start([sys.executable, BUSY, "60", "--torch"], tmp_path)
    try:
        (address, entries), *_ = _registered(tmp_path, 2).items()
        assert world.stdout is not None and world.stdout.readline().startswith("BUSY")
        pids = {e["name"]: e["pid"] for e in entries}
        os.kill(pids["worker1"], signal.SIGSTOP)  # a worker, not the store's: listed as silent
        try:
            (silent,) = _timed(tmp_path, ["asyncrpc-dump", "--json"])
        finally:
            os.kill(pids["worker1"], signal.SIGCONT)
        holder = store_holder(address)
        assert holder == pids["worker0"], (holder, pids)
        os.kill(holder, signal.SIGSTOP)
        try:
            dump, top = _timed(tmp_path, ["asyncrpc-dump"], ["asyncrpc-top", "--once"])
        finally:
            os.kill(holder, signal.SIGCONT)
    finally:
        _stop(world)
    took, done = silent
    # The commands' own wait is 5 s; past their start-up, a loaded machine adds to it.
    assert took < 10.0 and done.returncode == 0, (took, done.stderr)
    workers = {w["name"]: w for w in json.loads(done.stdout)["workers"]}
    assert "error" not in workers["worker0"], workers["worker0"]
    assert workers["worker1"]["pid"] == pids["worker1"]
    assert "it is stopped (SIGSTOP/Ctrl-Z)" in workers["worker1"]["error"], workers["worker1"]
    for took, done in (dump, top):
        assert took < 10.0 and done.returncode == 1, (took, done.stdout, done.stderr)
        said = f"the store at {address} (held by pid {holder}, worker0) does not answer: it is"
        assert said + " stopped (SIGSTOP/Ctrl-Z)" in done.stderr, done.stderr
        assert f"kill -CONT {holder}" in done.stderr and "Traceback" not in done.stderr


def test_a_wait_on_busy_threads_that_ends_is_waiting_not_a_cycle(tmp_path: pathlib.Path) -> None:
    # worker0's queue waits on f() (in the cycle) and slow() (not in it, and waiting on
    # nothing): once slow() returns, h() starts, and g() and f() end.
    # slow() returns once the dumps and the hang report are in (a fixed sleep ran out
    # first on a loaded machine), or after 60 s.
    release = tmp_path / "release"
    program = [sys.executable, str(PROGRAMS / "busy_threads_wait.py"), "60", str(release)]
    world = _start(program, tmp_path)
    reports = _Lines(world.stderr)
    try:
        _registered(tmp_path, 2)
        assert world.stdout is not None and world.stdout.readline().startswith("WAITING")
        live = _live_top(tmp_path)  # until the world ends by itself
        done = _command("asyncrpc-dump", tmp_path, "--json")
        text = _command("asyncrpc-dump", tmp_path)
        err = reports.wait_for("call to h() on worker0 still pending")
        release.touch()
        out, _ = world.communicate(timeout=60)  # the wait ends: the world does too
        _says_the_world_ended(live)
    finally:
        _stop(world)
    assert world.returncode == 0 and "RESULTS slow done h done" in out, (out, err[-3000:])
    result = json.loads(done.stdout)
    assert result["cycles"] == [] and result["waits"], result
    assert result["waits"][0]["ends_with"] == ["worker0 slow()"], result["waits"]
    assert "cycle:" not in text.stdout, text.stdout
    assert "waiting: worker0 f() -> worker1 g() -> worker0 (queued" in text.stdout, text.stdout
    assert "not a deadlock: it ends when worker0 slow() ends" in text.stdout
    # The hang reports say the same.
    assert "still pending after 2 s" in err and "cycle:" not in err, err[-3000:]
    assert "waiting: worker0 f() -> worker1 g()" in err


def _unwritable(runtime: pathlib.Path, temporary_too: bool) -> dict[str, str]:
    # A regular file where the folder would be: unwritable even for root.
    env = _env(runtime)
    (runtime / "asyncrpc").write_text("")
    if temporary_too:
        (pathlib.Path(env["TMPDIR"]) / f"asyncrpc-{os.getuid()}").write_text("")
    return env


def test_a_world_starts_where_no_registration_can_be_written_and_says_so_once(
    tmp_path: pathlib.Path,
) -> None:
    env = _unwritable(tmp_path, temporary_too=True)
    argv = [sys.executable, str(PROGRAMS / "unwritable_registry.py"), "twice"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.split() == ["RAN", "RAN"], done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "runs unregistered" in line]
    assert len(said) == 1, done.stderr[-3000:]  # two worlds, one process: said once
    assert str(tmp_path / "asyncrpc") in said[0] and "XDG_RUNTIME_DIR or TMPDIR" in said[0]


def test_a_world_registers_in_the_temporary_folder_where_the_runtime_one_is_unwritable(
    tmp_path: pathlib.Path,
) -> None:
    env = _unwritable(tmp_path, temporary_too=False)
    argv = [sys.executable, str(PROGRAMS / "unwritable_registry.py"), "serve"]
    world = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert world.stdout is not None and world.stdout.readline().startswith("READY")
        dump = _command("asyncrpc-dump", tmp_path, "--json")  # finds it in TMPDIR
        other = tmp_path / "other"  # a session with a runtime folder of its own: not its world
        other.mkdir()
        apart = subprocess.run(
            [bin_path("asyncrpc-dump")], cwd=ROOT, env={**env, "XDG_RUNTIME_DIR": str(other)},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        out, err = world.communicate("", timeout=60)
    finally:
        _stop(world)
    assert dump.returncode == 0, dump.stderr
    assert [w["name"] for w in json.loads(dump.stdout)["workers"]] == ["worker0"]
    assert apart.returncode == 1 and "no asyncrpc world is running" in apart.stderr
    assert world.returncode == 0 and "RAN" in out and "unregistered" not in err, err[-3000:]
