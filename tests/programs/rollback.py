"""A start that fails at one step puts everything back, and the next start works.

    python tests/programs/rollback.py STEP [interrupt]

STEP names a step of the world's start (`_world._build`): the step runs,
then fails (RuntimeError; KeyboardInterrupt with `interrupt`), the worst
case for its undo. `join` starts a world that heals (one worker, torch's
dynamic group). After the failed start: torch's agent is stopped, no
asyncrpc thread lives, torch's patches, the environment, the intra-op
thread count and the frozen heap are as before, the registration is gone;
then a world starts, answers a call and shuts down, leaving all as before.
Prints one line per check; exits 1 at the first difference.
"""

import gc
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from side_effects import differences, torch_state

from helpers import fail

STEPS = ("hooks", "agent", "threadstates", "watch", "join", "liveness", "freeze")


class Injected(RuntimeError):
    """The failure this program makes a step raise."""


def fail_after(holder: Any, attr: str, error: BaseException) -> None:
    """Make `holder.attr` run as it does, then raise `error`."""
    real: Callable[..., Any] = getattr(holder, attr)

    def failing(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise error

    setattr(holder, attr, failing)
    undo.append(lambda: setattr(holder, attr, real))


undo: list[Callable[[], None]] = []


def inject(step: str, error: BaseException) -> None:
    from asyncrpc._core import _healing, _hooks, _liveness, _threadstates, _world

    holder, attr = {
        "hooks": (_hooks, "install"),
        "agent": (_world, "_start_agent"),
        "threadstates": (_threadstates, "keep"),
        "watch": (_world, "_watch"),
        "join": (_healing, "join"),
        "liveness": (_liveness.Liveness, "start"),
        "freeze": (gc, "freeze"),
    }[step]
    fail_after(holder, attr, error)


def start(step: str) -> None:
    import asyncrpc
    from asyncrpc._core import _context, _membership, _world

    if step != "join":
        asyncrpc.init(rank=0, world_size=1, master_port=0, intra_op_threads=1)
        return
    settings = _context.Settings.from_options({"intra_op_threads": 1})
    joining = _membership.Joining(torch_id=0, tag="rollback", replacement=False)
    _world.start(
        0, 1, "worker0", "127.0.0.1", 0, settings, hosts_store=True, watch_peers=True,
        joining=joining,
    )  # fmt: skip


def asyncrpc_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("asyncrpc"))


def check_put_back(when: str, before: dict[str, object], env: dict[str, str]) -> None:
    from asyncrpc._core import _registry, _runtime, _threadstates, _torch

    if _torch.agent_running():
        fail(f"{when}: torch's agent still runs")
    print(f"{when}: agent stopped", flush=True)
    deadline = time.monotonic() + 2.0
    while asyncrpc_threads() and time.monotonic() < deadline:
        time.sleep(0.02)  # a thread told to stop may take a moment to end
    if asyncrpc_threads():
        fail(f"{when}: asyncrpc threads alive {asyncrpc_threads()}")
    print(f"{when}: no asyncrpc thread", flush=True)
    changed = differences(before, torch_state())
    if changed:
        fail(f"{when}: torch changed {changed}")
    print(f"{when}: torch unpatched", flush=True)
    if dict(os.environ) != env:
        diff = sorted(set(os.environ.items()) ^ set(env.items()))
        fail(f"{when}: environment changed {diff}")
    print(f"{when}: environment restored", flush=True)
    left = sorted(_registry.folder().glob("*.json"))
    world = _runtime.running_world()
    if left or world is not None or _threadstates.kept():
        fail(f"{when}: left {left}, world {world}, kept {_threadstates.kept()}")
    print(f"{when}: no registration, no world", flush=True)


def main() -> None:
    step = sys.argv[1]
    interrupt = sys.argv[2:] == ["interrupt"]
    if step not in STEPS:
        fail(f"unknown step {step!r}; one of {STEPS}")
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp()  # this run's registrations alone
    for key in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS"):
        os.environ.pop(key, None)
    import torch

    torch.set_num_threads(2)
    before, env = torch_state(), dict(os.environ)
    import asyncrpc

    error: BaseException = KeyboardInterrupt() if interrupt else Injected(f"{step} failed")
    inject(step, error)
    try:
        start(step)
    except BaseException as exc:
        if exc is not error:
            fail(f"start raised {exc!r}, not the step's failure")
    else:
        fail("start did not fail")
    print(f"start failed at {step}: {type(error).__name__}", flush=True)
    for put_back in undo:
        put_back()
    check_put_back("after the failed start", before, env)
    ctx = asyncrpc.init(rank=0, world_size=1, master_port=0, intra_op_threads=1)
    if asyncrpc.rpc_sync(ctx.name, int, args=("7",)) != 7:
        fail("the call after it gave a wrong answer")
    asyncrpc.shutdown()
    print("next world: call answered", flush=True)
    check_put_back("after the next world", before, env)


if __name__ == "__main__":
    main()
