"""Every way a world's parent can end leaves no process behind (checked on the process tree).

SIGTERM is what `timeout`, `kill`, SLURM and Kubernetes send; SIGKILL is the
OOM killer's; SIGINT is Ctrl-C. Whichever ends the parent of an embedded
world, its workers, the forkserver and multiprocessing's resource tracker end
within a few seconds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest

from conftest import PROGRAMS, ROOT
from processes import assert_gone, descendants, kill_tree, stacks

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]


_TGKILL = {"x86_64": 234, "aarch64": 131}  # the syscall's number, by machine


def signal_another_thread(pid: int, sig: int) -> None:
    """Send `sig` to a thread of `pid` other than its main one (tgkill), as the kernel may.

    A signal sent to a process goes to any of its threads that does not block
    it; the one that gets it is the only one whose wait is interrupted.
    """
    import ctypes

    number = _TGKILL.get(os.uname().machine)
    if number is None:
        pytest.skip(f"tgkill's number is not known here ({os.uname().machine})")
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert others, "the parent runs no thread besides its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, others[0], sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")


@pytest.mark.parametrize(
    ("sig", "hold"),
    [
        (signal.SIGTERM, False),
        (signal.SIGKILL, False),
        (signal.SIGINT, False),
        (-signal.SIGINT, False),  # to a thread of torch's, not the main one
        (signal.SIGKILL, True),
        (signal.SIGTERM, True),
    ],
    ids=[
        "SIGTERM",
        "SIGKILL",
        "SIGINT",
        "SIGINT-to-another-thread",
        "SIGKILL-workers-hold-the-GIL",
        "SIGTERM-workers-hold-the-GIL",
    ],
)
def test_the_parent_of_a_world_ending_by_any_signal_leaves_no_process(
    sig: int, hold: bool
) -> None:
    errors = tempfile.TemporaryFile("w+")
    parent = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "parent_dies.py"), *(["--hold-gil"] if hold else [])],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    workers: set[int] = set()
    try:
        while len(workers) < 3:
            line = parent.stdout.readline()
            assert line, "the world ended before its workers started"
            workers |= {int(pid) for pid in re.findall(r"WORKER \d+ (\d+)", line)}
        tree = descendants(parent.pid)
        assert workers <= tree and len(tree) >= 5, tree  # workers, forkserver, tracker
        if sig < 0:
            signal_another_thread(parent.pid, -sig)
        else:
            os.kill(parent.pid, sig)
        try:
            parent.wait(30)
        except subprocess.TimeoutExpired:
            where = stacks(parent, errors)
            raise AssertionError(f"the parent did not end:\n{where}") from None
        assert_gone(tree, within=8)
    finally:
        kill_tree(parent.pid)


def test_an_init_worlds_shutdown_with_a_dead_peer_raises_within_its_bound() -> None:
    from conftest import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROGRAMS / "dead_peer_shutdown.py"), str(rank), str(port)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        procs[1].kill()
        procs[1].wait(10)
        out, err = procs[0].communicate("go\n", timeout=30)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[0].returncode == 0, err[-2000:]
    assert "RAISED WorkerUnreachableError name=worker1" in out, out + err[-2000:]
    took = float(out.split(" after ")[1].split()[0])
    assert took < 3.0 + 5.0, out  # heartbeat_timeout (3 s) and the time to notice
    assert "stopped beating" in out, out


def test_a_program_that_does_not_end_fails_its_test_with_what_its_tree_was_doing() -> None:
    from conftest import run_program

    # The program prints its stack on SIGUSR1; its child does not (the signal ends it,
    # and its own child goes to init); that grandchild ignores SIGUSR1 and still ends.
    deaf = (
        "import os, signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
        "print('below me:', os.getpid(), flush=True); time.sleep(60)"
    )
    middle = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {deaf!r}]); time.sleep(60)"  # fmt: skip  # noqa: E501
    stuck = (
        "import faulthandler, signal, subprocess, sys, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        f"subprocess.Popen([sys.executable, '-c', {middle!r}])\n"
        "def waits_forever(): time.sleep(60)\n"
        "waits_forever()\n"
    )
    with pytest.raises(AssertionError) as failed:
        run_program("python", "-c", stuck, timeout=5)
    said = str(failed.value)
    assert "did not end within 5 s" in said and "\nbelow me: " in said, said
    assert "in waits_forever" in said, said  # the stack it was in, not only its output
    child = int(said.split("\nbelow me: ")[1].split()[0])
    assert_gone({child}, within=5)  # the whole tree as it was, though one left it
