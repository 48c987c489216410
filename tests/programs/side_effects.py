"""Importing asyncrpc changes nothing in torch; a world patches torch, its shutdown puts it back.

After the last shutdown nothing of asyncrpc stays registered: no atexit
callback (nor an emptied slot), no signal handler, no thread.

    python tests/programs/side_effects.py [init|torch|torch-shutdown]

`init`: a world started by asyncrpc.init; `torch`: one started by torch's
own rpc.init_rpc and adopted by asyncrpc, ended by asyncrpc.shutdown();
`torch-shutdown`: the same, ended by torch's own rpc.shutdown() (asyncrpc
notices within a moment, and removes its registration for asyncrpc-dump too).
Prints one line per step; exits non-zero at the first difference.
"""

import atexit
import gc
import importlib
import os
import signal
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed.rpc as rpc

KEYS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Python 3.12 starts with a few hundred objects frozen (3.11 and 3.13 with none): a
# world's shutdown thaws them with its own (harmless), so only a program's count
# above that is a frozen heap of its own.
PYTHONS_OWN = gc.get_freeze_count()


def torch_state() -> dict[str, object]:
    """What asyncrpc may change in torch: classes, registries, hooks, environment."""
    from torch._C._distributed_rpc import PyRRef
    from torch.distributed.rpc import internal

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    state: dict[str, object] = {
        f"{cls.__module__}.{cls.__qualname__}": dict(vars(cls))
        for cls in (torch._C.Future, torch.futures.Future, PyRRef, internal._InternalRPCPickler)
    }
    state["the RPC pickler"] = dict(vars(internal._internal_rpc_pickler))
    state["torch._C._collect_all"] = torch._C._collect_all
    state["rendezvous handlers"] = dict(handlers)
    state["warning filters"] = len(warnings.filters)
    state["environment"] = {k: os.environ.get(k) for k in KEYS}
    state["intra-op threads"] = torch.get_num_threads()
    state["frozen objects"] = gc.get_freeze_count() > PYTHONS_OWN
    return state


def process_state() -> dict[str, object]:
    """What a world may leave in the process: atexit slots, signal handlers, threads."""
    return {
        # atexit keeps a slot for every registration, unregistered ones too.
        "atexit slots": atexit._ncallbacks(),  # type: ignore[attr-defined]
        "signal handlers": {
            s.name: signal.getsignal(s)
            for s in signal.valid_signals()
            if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)
        },
    }


def asyncrpc_threads() -> list[str]:
    """asyncrpc's threads alive now, known by the module their target lives in."""
    found = []
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        module = getattr(target, "__module__", "") or ""
        owner = getattr(getattr(target, "__self__", None), "__module__", "") or ""
        if module.startswith("asyncrpc") or owner.startswith("asyncrpc"):
            found.append(thread.name)
    return found


def differences(before: dict[str, object], after: dict[str, object]) -> list[str]:
    found = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed = sorted(k for k in set(old) | set(new) if old.get(k) is not new.get(k))
            if changed:
                found.append(f"{key}: {changed}")
        elif old != new:
            found.append(f"{key}: {old!r} -> {new!r}")
    return found


def asyncrpc_exit_callbacks() -> list[str]:
    """Run the atexit callbacks now and name those of asyncrpc that ran (there must be none).

    atexit keeps a slot for an unregistered callback, so counting slots cannot tell.
    """
    called: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        # Known by the module a function belongs to, not by a word in its path: the
        # environment torch lives in may itself sit under a folder named asyncrpc.
        module = str(frame.f_globals.get("__name__", ""))  # type: ignore[attr-defined]
        if event == "call" and (module == "asyncrpc" or module.startswith("asyncrpc.")):
            called.append(f"{module}.{frame.f_code.co_name}")  # type: ignore[attr-defined]

    sys.setprofile(profile)
    try:
        atexit._run_exitfuncs()
    finally:
        sys.setprofile(None)
    return called


def check(step: str, before: dict[str, object], expect_same: bool = True) -> None:
    found = differences(before, torch_state())
    if bool(found) == expect_same:
        print(f"{step}: {'changed' if found else 'unchanged'} {found}", flush=True)
        sys.exit(1)
    print(f"{step}: {'unchanged' if expect_same else 'patched'}", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "init"
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp()  # this run's registrations alone
    for key in KEYS:
        os.environ.pop(key, None)
    torch.set_num_threads(2)
    before = torch_state()
    import asyncrpc

    process_before = process_state()
    check("after import", before)
    if mode == "init":
        asyncrpc.init(rank=0, world_size=1, master_port=0, intra_op_threads=1)
        print(f"during: TP_SOCKET_IFNAME={os.environ.get('TP_SOCKET_IFNAME')}")
    else:
        options = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:0")
        rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=options)
        assert asyncrpc.rpc_sync("worker0", int, args=("7",)) == 7  # adopted on first use
    check("during the world", before, expect_same=False)
    during = asyncrpc_threads()
    if "asyncrpc-cancels" not in during:
        print(f"during the world: no cancel watcher among {during}", flush=True)
        sys.exit(1)
    registered = sorted(asyncrpc._core._registry.folder().glob("*.json"))
    if mode == "torch-shutdown":
        rpc.shutdown()  # torch's own: asyncrpc's exit guard sees the agent gone
        deadline = time.monotonic() + 5
        while asyncrpc_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        asyncrpc.shutdown()
    assert not asyncrpc._core._torch.agent_running(), "the agent is still up"
    check("after shutdown", before)
    still = sorted(asyncrpc._core._registry.folder().glob("*.json"))
    if len(registered) != 1 or still:
        print(f"after shutdown: registrations {registered} -> {still}", flush=True)
        sys.exit(1)
    print("after shutdown: its registration removed", flush=True)
    left = asyncrpc_threads()
    if left:
        print(f"after shutdown: threads left {left}", flush=True)
        sys.exit(1)
    print(f"after shutdown: no thread of asyncrpc (during: {sorted(during)})", flush=True)
    changed = differences(process_before, process_state())
    if changed:
        print(f"after shutdown: process changed {changed}", flush=True)
        sys.exit(1)
    print("after shutdown: atexit slots and signal handlers as before", flush=True)
    # torch's agent module loads asyncrpc's rendezvous entry point (torch's doing),
    # which must not patch the agent: only a launcher's rendezvous does, for its run.
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert not getattr(LocalElasticAgent._monitor_workers, "_asyncrpc", False)
    print("torch's elastic agent: unpatched", flush=True)
    leftovers = asyncrpc_exit_callbacks()
    if leftovers:
        print(f"at exit: asyncrpc still registered {leftovers}", flush=True)
        sys.exit(1)
    print("at exit: nothing of asyncrpc runs", flush=True)
