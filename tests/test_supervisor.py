"""asyncrpc.run: the same program embedded, under asyncrpc-launch and under torchrun."""

import os
import pathlib
import re
import signal
import time

import pytest

from conftest import PROGRAMS, ROOT, bin_path, run_program, start_program

RING = str(ROOT / "examples" / "ring.py")
RING_OUTPUT = [
    "worker1 got [10.0, 10.0] from worker0",
    "worker2 got [11.0, 11.0] from worker1",
    "worker0 got [12.0, 12.0] from worker2",
]


@pytest.mark.parametrize(
    "launcher",
    [
        ["python"],
        [bin_path("asyncrpc-launch"), "--nproc-per-node", "3"],
        [bin_path("torchrun"), "--nproc-per-node", "3"],
    ],
    ids=["embedded", "asyncrpc-launch", "torchrun"],
)
def test_ring_prints_the_same_three_ways(launcher: list[str]) -> None:
    done = run_program(*launcher, RING)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == RING_OUTPUT


@pytest.mark.subprocess
def test_a_deep_tmpdir_still_starts_an_embedded_world(tmp_path: pathlib.Path) -> None:
    # The warm interpreter's socket lives under TMPDIR and must fit AF_UNIX's 107
    # bytes: under a deeper TMPDIR its folder is made in a short one instead.
    deep = tmp_path / ("deep" * 10) / ("er" * 20)
    deep.mkdir(parents=True)
    assert len(str(deep)) > 100
    done = run_program("python", RING, env={"TMPDIR": str(deep)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == RING_OUTPUT


def test_roles_name_the_workers_and_args_reach_main() -> None:
    done = run_program("python", str(PROGRAMS / "roles.py"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "hello from ps0",
        "ps0:ps trainer0:trainer trainer1:trainer",
        "trainers trainer0,trainer1",
    ]


def test_a_raising_worker_fails_the_run_with_its_traceback() -> None:
    start = time.monotonic()
    done = run_program("python", str(PROGRAMS / "raises.py"))
    assert done.returncode != 0
    assert time.monotonic() - start < 30
    assert "WorkerFailedError: worker 'worker2' (rank 2) raised:" in done.stderr
    assert "ExampleFailure: worker2 could not load its shard" in done.stderr
    assert 'raises.py", line' in done.stderr  # the worker's own traceback


@pytest.mark.timeout(90)
def test_a_worker_that_exits_0_while_its_world_runs_fails_the_run_naming_it() -> None:
    # Not a return from main: the others would wait for it in torch's graceful
    # shutdown for good. Only a worker that returned and left the world is done.
    start = time.monotonic()
    done = run_program("python", str(PROGRAMS / "early_exit.py"), timeout=80)
    assert done.returncode != 0, done.stderr[-3000:]
    assert time.monotonic() - start < 40
    said = "worker 'worker1' (rank 1) exited with code 0 while its world still ran"
    assert said in done.stderr, done.stderr[-3000:]


def test_a_raising_worker_under_torchrun_is_named() -> None:
    done = run_program(bin_path("torchrun"), "--nproc-per-node", "3", str(PROGRAMS / "raises.py"))
    assert done.returncode != 0
    assert "asyncrpc: worker 'worker2' (rank 2, node " in done.stderr
    assert "raised ExampleFailure: worker2 could not load its shard" in done.stderr


def _wait_for_pids(pids_dir: pathlib.Path, count: int, timeout: float = 60) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(pids_dir.iterdir())
        if len(files) == count and all(f.read_text() for f in files):
            return {f.name: int(f.read_text()) for f in files}
        time.sleep(0.1)
    raise AssertionError(f"workers did not start: {list(pids_dir.iterdir())}")


@pytest.mark.timeout(120)
def test_a_killed_worker_fails_the_run_within_30_s(tmp_path: pathlib.Path) -> None:
    import sys

    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    proc = start_program(
        sys.executable, str(PROGRAMS / "busy.py"), env={"PIDS_DIR": str(pids_dir)}
    )
    try:
        pids = _wait_for_pids(pids_dir, 3)
        time.sleep(0.5)  # calls to worker1 are in flight
        killed_at = time.monotonic()
        os.kill(pids["worker1"], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - killed_at
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert elapsed < 30
    assert "worker 'worker1' (rank 1) was killed by SIGKILL" in err
    for pid in pids.values():  # nothing is left behind
        assert not pathlib.Path(f"/proc/{pid}").exists() or _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_run_rejects_bad_max_restarts() -> None:
    import asyncrpc

    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
            asyncrpc.run(_module_main, world_size=2, max_restarts=bad)  # type: ignore[arg-type]


def test_run_rejects_a_lambda() -> None:
    import asyncrpc

    with pytest.raises(TypeError, match="module-level function"):
        asyncrpc.run(lambda ctx: None, world_size=2)
    with pytest.raises(TypeError, match="expects a function main"):
        asyncrpc.run(print(), world_size=2)  # type: ignore[arg-type, func-returns-value]


def test_run_rejects_args_it_cannot_send() -> None:
    import asyncrpc

    with pytest.raises(TypeError, match=r"cannot be pickled.*module-level"):
        asyncrpc.run(_module_main, world_size=2, args=(lambda: 1,))


@pytest.mark.subprocess
def test_a_worker_that_cannot_load_main_says_why() -> None:
    done = run_program("python", str(PROGRAMS / "main_guarded.py"), timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "could not load main and args" in done.stdout, done.stdout
    assert "Can't get attribute 'helper'" in done.stdout, done.stdout
    assert 'not under `if __name__ == "__main__":`' in done.stdout, done.stdout


@pytest.mark.subprocess
def test_a_script_without_the_main_guard_is_told_where_to_put_run() -> None:
    done = run_program("python", str(PROGRAMS / "unguarded.py"), timeout=60)
    assert done.returncode != 0
    assert "asyncrpc.run was called again while a worker process imported" in done.stderr
    assert 'put the call under if __name__ == "__main__":' in done.stderr, done.stderr[-3000:]
    assert "before it could report an error" in done.stderr, done.stderr[-3000:]


@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["function", "args"])
def test_run_from_python_c_names_the_cause_and_the_fix(how: str) -> None:
    # python -c (and notebooks, and the prompt) define main in a __main__ with no
    # file: workers cannot import it, so run says so before starting any.
    passed = "main, world_size=2" if how == "function" else "print, world_size=2, args=(P(),)"
    program = (
        "import asyncrpc\n"
        "class P:\n    pass\n"
        "def main(ctx):\n    print(ctx.name)\n"
        f"asyncrpc.run({passed})\n"
    )
    done = run_program("python", "-c", program, timeout=60)
    assert done.returncode != 0
    named = "main" if how == "function" else "P"
    assert f"but {named} is defined in a program that has no file" in done.stderr, done.stderr
    assert "python -c, a script read from stdin, a notebook" in done.stderr
    assert "%%writefile my_world.py" in done.stderr
    assert "alive_r" not in done.stderr  # not multiprocessing's own main, as before


def test_run_needs_a_size_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncrpc

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="needs world_size=N"):
        asyncrpc.run(_module_main)


def _module_main(ctx: object) -> None:
    pass


def test_restart_example_resumes_from_its_checkpoint() -> None:
    done = run_program("python", str(ROOT / "examples" / "restart.py"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "attempt 0: starting at step 0",
        "step 0 done",
        "step 1 done",
        "step 2 done",
        "attempt 1: starting at step 3",
        "step 3 done",
        "step 4 done",
        "step 5 done",
        "attempt 1: all 6 steps done",
    ]
    assert (
        "worker 'worker1' (rank 1) was killed by SIGKILL; restarting the world (restart 1 of 1)"
        in done.stderr
    )


@pytest.mark.subprocess
@pytest.mark.timeout(150)
def test_heal_example_replaces_the_actor_while_the_learner_goes_on() -> None:
    done = run_program("python", str(ROOT / "examples" / "heal.py"), timeout=140)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:-1] == [
        "learner: actors on worker1, worker2, worker3",
        "step 5: worker2 died during its rollout (a simulated crash); the call raised "
        "WorkerUnreachableError; skipping worker2 until it is replaced",
        "worker2 was replaced (attempt 1); its actor is back",
        "final policy evaluated on worker1, worker2, worker3",
        # one learner process from step 0 to 20: the world was not restarted
        "learner state survived: 20 steps, policy v0 -> v20 in one process (attempt 0), "
        "never reset",
    ], done.stdout
    took = re.fullmatch(
        r"the heal took (\d+\.\d\d) s \(from the crash to the new actor's first answer\)",
        lines[-1],
    )
    assert took is not None and 0 < float(took.group(1)) < 30, lines[-1]
    healed = (
        "worker 'worker2' (rank 2) was killed by SIGKILL; replacing it in place (restart 1 of 2)"
    )
    assert healed in done.stderr and "restarting the world" not in done.stderr, done.stderr[-3000:]
