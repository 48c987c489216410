"""Every private torch name and message text asyncrpc relies on, checked against this torch.

The package asyncrpc/_core/_torch/ is the only code that touches them; if an upgrade of
torch moves one, a test here fails by name. A check of the package's source (with `ast`)
fails, by file and line, where any module outside it imports or reaches one.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import pathlib
import re
import sys
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc

import asyncrpc
from asyncrpc._core import _torch
from asyncrpc._core._torch import _install, _patches, _versions

from conftest import PROGRAMS, run_program, until

PACKAGE = pathlib.Path(asyncrpc.__file__).parent
BOUNDARY = PACKAGE / "_core" / "_torch"  # every file in this folder, and no other
_ATTR_CALLS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(dotted: str) -> bool:
    """Whether a dotted torch name has a component after `torch` with one leading underscore."""
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])


def _torch_aliases(tree: ast.AST) -> dict[str, str]:
    """Each local name bound to a torch module or object by the file's imports, anywhere in it."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    local = alias.asname or alias.name.split(".")[0]
                    aliases[local] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "torch":
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The torch name an `a.b.c` expression reaches, with its root alias resolved, or None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _is_private_part(node: ast.expr, aliases: dict[str, str]) -> bool:
    """Whether `node` already is a private torch name (its use was reported where it began)."""
    dotted = _dotted(node, aliases)
    return dotted is not None and _private(dotted)


def _reached(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The private torch name this one node newly reaches (so a chain is reported once)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"] or [node.module]
    elif isinstance(node, ast.Attribute) and not _is_private_part(node.value, aliases):
        names = [_dotted(node, aliases) or ""]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
        owner, name = _dotted(node.args[0], aliases), node.args[1]
        if node.func.id not in _ATTR_CALLS or not owner or _private(owner):
            return None
        if not isinstance(name, ast.Constant):
            return None
        names = [f"{owner}.{name.value!s}"]  # getattr(torch, "_C") and the like
    else:
        return None
    return next((n for n in names if n.split(".")[0] == "torch" and _private(n)), None)


def private_torch_uses(source: str, filename: str = "<source>") -> list[str]:
    """`file:line: name` for each import or attribute access reaching a private torch name."""
    tree = ast.parse(source, filename)
    aliases = _torch_aliases(tree)
    found = []
    for node in ast.walk(tree):
        name = _reached(node, aliases)
        if name is not None and isinstance(node, ast.stmt | ast.expr):
            found.append((node.lineno, f"{filename}:{node.lineno}: {name}"))
    return [text for _, text in sorted(found)]


def test_only_the_boundary_package_reaches_torchs_private_names() -> None:
    found = []
    paths = sorted(PACKAGE.rglob("*.py"))
    inside = [path for path in paths if path.is_relative_to(BOUNDARY)]
    # The walk sees the whole package, the boundary's modules among them.
    assert BOUNDARY / "__init__.py" in inside and len(inside) > 5 and len(paths) > 20, paths
    for path in paths:
        if path not in inside:
            where = path.relative_to(PACKAGE.parent).as_posix()
            found += private_torch_uses(path.read_text(), where)
    assert not found, (
        "private torch names reached outside asyncrpc/_core/_torch/; move each into a "
        "named function of a module there and call it:\n" + "\n".join(found)
    )


def test_the_boundarys_modules_reach_private_names_the_check_sees() -> None:
    # Each concern's module really is inside the boundary: the check would flag it elsewhere.
    for name in ("_agent.py", "_install.py", "_modules.py", "_reads.py", "_rrefs.py"):
        assert private_torch_uses((BOUNDARY / name).read_text(), name), name


def test_each_boundary_module_says_what_it_owns_and_the_package_gathers_them() -> None:
    for path in sorted(BOUNDARY.glob("*.py")):
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.name} opens with no docstring"
        lines = len(path.read_text().splitlines())
        assert lines <= 600, f"{path.name} has {lines} lines"
        names = [n for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "__all__" for t in n.targets)]  # fmt: skip
        assert len(names) == 1 and isinstance(names[0].value, ast.Tuple), path.name
    assert isinstance(_torch.__all__, tuple)
    for name in _torch.__all__:
        assert getattr(_torch, name) is not None, name


def test_patches_put_back_newest_first_and_closing_twice_is_closing_once() -> None:
    class Holder:
        kept = "torch's"

    table = {"old": 1}
    patches = _patches.Patches()  # not the world's part: nothing of torch is touched
    patches.patch(Holder, "kept", "ours")
    patches.patch(Holder, "kept", "ours again")  # what was there first is remembered
    patches.patch(Holder, "added", 1)
    patches.patch(table, "old", 2)
    patches.patch(table, "new", 3)
    assert (Holder.kept, table) == ("ours again", {"old": 2, "new": 3})
    patches.close()
    patches.close()
    assert Holder.kept == "torch's" and not hasattr(Holder, "added") and table == {"old": 1}
    assert not patches.patched and patches.hooks is None


def test_the_boundary_check_sees_private_names_through_aliases() -> None:
    bad = (
        "import torch.distributed.rpc as rpc\n"
        "from torch._C import Future\n"
        "from torch.distributed import rpc as r2\n"
        "import torch.distributed as dist\n"
        "def f():\n"
        "    rpc.api._get_current_rpc_agent()\n"
        "    x = r2._utils\n"
        "    dist.rpc.api._wait_all()\n"
        "    getattr(torch, '_dynamo')\n"
        "    import torch\n"
        "    return torch._C._distributed_rpc.PyRRef\n"
    )
    assert private_torch_uses(bad) == [
        "<source>:2: torch._C.Future",
        "<source>:6: torch.distributed.rpc.api._get_current_rpc_agent",
        "<source>:7: torch.distributed.rpc._utils",
        "<source>:8: torch.distributed.rpc.api._wait_all",
        "<source>:9: torch._dynamo",
        "<source>:11: torch._C",
    ]
    clean = (
        "import torch\n"
        "import torch.distributed.rpc as rpc\n"
        "from torch.futures import Future\n"
        "from . import _torch\n"
        "_x = object()\n"
        "print(torch.__version__, rpc.api.get_worker_info, _torch._require, _x._y)\n"
    )
    assert private_torch_uses(clean) == []


_sleeps_ended: dict[str, int] = {}  # on the worker that slept: sleeps over, by tag
_sleeps_lock = threading.Lock()


def sleepy(seconds: float, tag: str = "") -> float:
    try:
        time.sleep(seconds)
        return seconds
    finally:
        with _sleeps_lock:
            _sleeps_ended[tag] = _sleeps_ended.get(tag, 0) + 1


def sleeps_ended(tag: str) -> int:
    with _sleeps_lock:
        return _sleeps_ended.get(tag, 0)


def give_lock() -> threading.Lock:
    return threading.Lock()


def return_worker_only(folder: str) -> object:
    with open(os.path.join(folder, "worker_only_value.py"), "w") as f:
        f.write("class Value:\n    pass\n")
    sys.path.insert(0, folder)
    import worker_only_value  # type: ignore[import-not-found]

    return worker_only_value.Value()


def plain(x: int) -> int:
    return x


def world_settings_timeout() -> float:
    return float(torch.distributed.rpc.get_rpc_timeout())  # type: ignore[attr-defined]


def test_agent_and_its_options(world: asyncrpc.Context) -> None:
    assert _torch.agent_running()
    assert [info.name for info in _torch.worker_infos()] == list(world.names)
    assert _torch.agent_threads() == asyncrpc.Settings().num_worker_threads
    assert _torch.default_timeout() == world_settings_timeout() > 0
    assert torch.distributed.rpc.api._get_current_rpc_agent() is _torch.current_agent()
    assert _torch.current_agent() is _torch.current_agent()  # adoption's cache key


def test_rpc_threads_are_told_apart(world: asyncrpc.Context) -> None:
    assert not _torch.is_rpc_thread()
    assert asyncrpc.rpc_sync("worker1", _torch.is_rpc_thread) is True


def test_builtins_and_the_async_mark() -> None:
    assert _torch.is_builtin(torch.add) and not _torch.is_builtin(plain)
    marked = rpc.functions.async_execution(plain)
    assert _torch.async_target(marked) is plain  # torch's own decorator sets what we read
    _torch.mark_async(sleepy, plain)
    try:
        assert _torch.async_target(sleepy) is plain
    finally:
        delattr(sleepy, _torch.ASYNC_MARK)


def test_unwrap_hook_raises_with_the_type_kept() -> None:
    fut: torch.futures.Future[int] = torch.futures.Future()

    def check(value: object) -> None:
        raise KeyError(value)

    _torch.set_unwrap(fut, check)
    fut.set_result(3)
    with pytest.raises(KeyError, match="3"):
        fut.wait()


class LocalError(Exception):
    pass


def test_rref_future_and_remote_exception(world: asyncrpc.Context) -> None:
    rref = _torch.remote("worker1", plain, args=(4,))
    _torch.rref_future(rref).wait()
    assert rref.to_here() == 4
    make, (text, cls) = _torch.remote_exception("msg", KeyError)
    wire = make(text, cls)
    assert (wire.msg, wire.exception_type) == ("msg", KeyError)

    def nested() -> type[Exception]:
        class Inner(Exception):
            pass

        return Inner

    # A class a torch caller could not import by name crosses as RuntimeError.
    assert _torch.remote_exception("msg", nested())[1][1] is RuntimeError
    assert _torch.remote_exception("msg", LocalError)[1][1] is LocalError


def test_futures_made_inside_torchs_wait_all_are_waited_for(world: asyncrpc.Context) -> None:
    from torch.distributed.rpc import api

    with api._wait_all():
        fut = asyncrpc.rpc_async("worker1", sleepy, args=(0.3,))
        assert not fut.done()
    assert fut.done() and fut.wait() == 0.3


def raise_key(key: str) -> None:
    raise KeyError(key)


def test_wait_all_ends_at_the_first_failed_call(world: asyncrpc.Context) -> None:
    # As it does for torch's own failed calls: the failure is a value torch does not see.
    slow = asyncrpc.rpc_async("worker1", sleepy, args=(1.5,))
    started = time.monotonic()
    with pytest.raises(KeyError, match="early"):
        torch.futures.wait_all([slow, asyncrpc.rpc_async("worker2", raise_key, args=("early",))])
    assert time.monotonic() - started < 1.0
    assert slow.wait() == 1.5


def test_a_missing_private_hook_is_named_with_the_tested_versions() -> None:
    with pytest.raises(asyncrpc.UnsupportedTorchError) as raised:
        _versions.require({"torch._C.Future._no_such_hook": lambda: torch._C.Future._no_such_hook})
    text = str(raised.value)
    assert "torch._C.Future._no_such_hook" in text and torch.__version__ in text
    for version in _torch.TESTED_TORCH:
        assert version in text
    _versions.require(_install.CORE_HOOKS)  # this torch has every hook the core patches


def test_send_python_reaches_torchs_udf_entry(world: asyncrpc.Context) -> None:
    info = rpc.get_worker_info("worker1")
    assert _torch.send_python(info, plain, (5,), {}, 10.0, False).wait() == 5
    with pytest.raises(TypeError, match=r"not a WorkerInfo|incompatible"):
        _torch.send_python("worker1", plain, (5,), {}, 10.0, False)  # type: ignore[arg-type]


def test_reads_of_a_sent_future_name_torchs_failure(world: asyncrpc.Context) -> None:
    tag = "sent-future"

    def sent() -> torch.futures.Future[float]:
        return asyncrpc.rpc_async("worker1", sleepy, args=(1.0, tag), timeout=0.2)

    with pytest.raises(asyncrpc.CallTimeoutError, match="worker1"):
        sent().wait()
    with pytest.raises(asyncrpc.CallTimeoutError, match="worker1"):
        torch.futures.wait_all([asyncrpc.rpc_async("worker1", plain, args=(1,)), sent()])
    seen: list[BaseException] = []
    done = threading.Event()

    def record(fut: torch.futures.Future[float]) -> None:
        try:
            fut.value()
        except BaseException as exc:
            seen.append(exc)
        done.set()

    sent().add_done_callback(record)  # the caller keeps no wrapper of its own
    gc.collect()
    assert done.wait(10)
    assert isinstance(seen[0], asyncrpc.CallTimeoutError) and "worker1" in str(seen[0])
    raw = _torch.rpc_async("worker1", sleepy, args=(1.0, tag), timeout=0.2)
    with pytest.raises(RuntimeError) as raised:  # torch's own calls stay torch's
        raw.wait()
    assert not isinstance(raised.value, asyncrpc.AsyncRPCError)
    # worker1's four sleepers outlive their timeout: the next test finds its threads free.
    assert until(lambda: asyncrpc.rpc_sync("worker1", sleeps_ended, args=(tag,)) >= 4), (
        f"{asyncrpc.rpc_sync('worker1', sleeps_ended, args=(tag,))} of worker1's 4 sleepers ended"
    )


def test_world_caches_worker_infos(world: asyncrpc.Context) -> None:
    from asyncrpc._core import _world

    current = _world.current_world("test")
    info = current.info("worker1")
    assert isinstance(info, _torch.WorkerInfo) and info.name == "worker1"
    assert current.info("worker1") is info


def test_profiling_is_torchs_process_wide_profiler_flag() -> None:
    assert not _torch.profiling()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        seen = []
        thread = threading.Thread(target=lambda: seen.append(_torch.profiling()))
        thread.start()
        thread.join()
        assert _torch.profiling() and seen == [True]  # every thread sees it
    assert not _torch.profiling()


def test_hook_tables_are_torchs_for_modules_tensors_and_every_module() -> None:
    layer = torch.nn.Linear(2, 2)
    assert not any(_torch.hook_tables(layer).values()) and not any(
        map(len, _torch.call_hook_tables(layer))
    )
    handles = [
        layer.register_forward_hook(lambda m, a, out: None),
        layer.register_forward_pre_hook(lambda m, a: None),
        layer.register_full_backward_hook(lambda m, gin, gout: None),
        layer.register_full_backward_pre_hook(lambda m, gout: None),
        layer.register_state_dict_post_hook(lambda m, sd, prefix, meta: None),  # type: ignore[no-untyped-call]
    ]
    assert list(map(len, _torch.call_hook_tables(layer))) == [1, 1, 1, 1]
    assert sum(map(len, _torch.hook_tables(layer).values())) >= 5
    tables = list(_torch.tensor_tables(layer))
    assert not _torch.any_tensor_hooks(tables) and not _torch.tensor_hooks(layer.weight)
    handles.append(layer.bias.register_post_accumulate_grad_hook(lambda p: None))
    assert _torch.any_tensor_hooks(tables) and _torch.tensor_hooks(layer.bias)
    handles.append(
        torch.nn.modules.module.register_module_full_backward_pre_hook(lambda m, g: None)
    )
    assert sum(map(len, _torch.global_call_hook_tables())) == 1
    for handle in handles:
        handle.remove()
    assert not any(map(len, _torch.call_hook_tables(layer)))
    assert not _torch.any_tensor_hooks(tables) and not any(
        map(len, _torch.global_call_hook_tables())
    )


def test_options_store_profiler_and_rendezvous_registry() -> None:
    options = _torch.backend_options(4, 10.0, "env://", ["uv"], ["basic"])
    assert options.num_worker_threads == 4
    assert issubclass(_torch.TCPStore, _torch.Store)
    assert _torch.profiler_config() is not None
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    _torch.register_rendezvous("asyncrpc-boundary-test", lambda params: None)
    assert "asyncrpc-boundary-test" in rendezvous_handler_registry._registry


class Unreadable:
    """Pickles; its __setstate__ raises where it is unpickled (the callee, for a request)."""

    def __getstate__(self) -> dict[str, int]:
        return {"x": 1}

    def __setstate__(self, state: dict[str, int]) -> None:
        raise ValueError("cannot rebuild Unreadable here")


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (lambda: _torch.rpc_async("worker1", sleepy, args=(2.0,), timeout=0.2).wait(), "timeout"),
        (lambda: _torch.rpc_sync("worker1", give_lock), "unpicklable"),
        (lambda: _torch.rpc_sync("worker1", repr, args=(Unreadable(),)), "unreadable"),
    ],
    ids=["timeout", "unpicklable", "unreadable"],
)
def test_torchs_failure_texts_are_recognised(
    world: asyncrpc.Context, call: object, kind: str
) -> None:
    with pytest.raises(RuntimeError) as raised:
        call()  # type: ignore[operator]
    assert _torch.failure_kind(raised.value) == kind, str(raised.value)


def test_torchs_text_for_a_reply_it_cannot_import(world: asyncrpc.Context) -> None:
    with tempfile.TemporaryDirectory() as folder, pytest.raises(RuntimeError) as raised:
        _torch.rpc_sync("worker1", return_worker_only, args=(folder,))
    assert _torch.failure_kind(raised.value) == "unimportable", str(raised.value)


def test_torchs_transport_texts_are_recognised() -> None:
    # Provoked end to end by the killed-worker row of tests/programs/failure_table.py.
    for text in [
        "EOF: end of file (this error originated at tensorpipe/transport/uv/connection_impl.cc)",
        "pipe closed (this error originated at tensorpipe/core/pipe_impl.cc:356)",
    ]:
        assert _torch.failure_kind(RuntimeError(text)) == "unreachable"
    assert _torch.failure_kind(RuntimeError("KeyError: 'x'")) is None


def test_rref_to_here_names_the_owner_on_torchs_failures(world: asyncrpc.Context) -> None:
    rref = _torch.remote("worker2", sleepy, args=(2.0,))
    with pytest.raises(asyncrpc.CallTimeoutError, match="worker2") as raised:
        rref.to_here(timeout=0.2)
    assert isinstance(raised.value, RuntimeError)  # what torch raises there
    assert rref.to_here() == 2.0  # other outcomes pass through untouched


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["init", "torch", "torch-shutdown"])
def test_import_changes_nothing_and_the_last_shutdown_puts_torch_back(
    mode: str, tmp_path: pathlib.Path
) -> None:
    # The interpreter is reached through a folder named asyncrpc-env, so torch's own
    # files sit under a path with that word (as in a clone named asyncrpc): only
    # asyncrpc's own callbacks may count as asyncrpc's.
    env = tmp_path / "asyncrpc-env"
    env.symlink_to(pathlib.Path(sys.prefix))
    python = env / pathlib.Path(sys.executable).relative_to(sys.prefix)
    if not python.exists():  # not a virtual environment: run it as it is
        python = pathlib.Path(sys.executable)
    result = run_program(str(python), str(PROGRAMS / "side_effects.py"), mode, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for step in (
        "after import: unchanged",
        "during the world: patched",
        "after shutdown: unchanged",
        "after shutdown: its registration removed",
        "after shutdown: no thread of asyncrpc (during: ['asyncrpc-cancels'",
        "after shutdown: atexit slots and signal handlers as before",
        "torch's elastic agent: unpatched",
        "at exit: nothing of asyncrpc runs",
    ):
        assert step in result.stdout, result.stdout
    if mode == "init":
        assert "during: TP_SOCKET_IFNAME=lo" in result.stdout, result.stdout


@pytest.mark.subprocess
def test_a_torch_without_a_hook_is_refused_cleanly() -> None:
    result = run_program("python", str(PROGRAMS / "missing_hook.py"), timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "refused: asyncrpc needs torch's private torch._C._no_such_hook" in result.stdout
    assert "started after: OK" in result.stdout, result.stdout


def test_the_static_rendezvous_keeps_its_store_where_we_put_it() -> None:
    made: list[tuple[str, int, float]] = []

    def host(addr: str, port: int, timeout: float) -> object:
        made.append((addr, port, timeout))
        return _torch.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    handler_class = _torch.bound_static_rendezvous("asyncrpc", host, host)
    handler = handler_class("127.0.0.1", 0, 0, 1, "run", 5)
    assert handler._store is None  # torch's private slot, filled on first use
    info = handler.next_rendezvous()
    assert made == [("127.0.0.1", 0, 5.0)] and handler._store is not None
    assert info.rank == 0 and info.world_size == 1 and handler.get_backend() == "asyncrpc"


def test_share_version_links_a_tensor_to_a_row_keeping_what_it_is() -> None:
    layer = torch.nn.Linear(3, 2)
    weight = layer.weight
    weight.grad = torch.ones(2, 3)
    weight.tag = "mine"  # type: ignore[attr-defined]
    stack = torch.zeros(4, 2, 3)
    assert _torch.share_version(weight, stack[1])
    assert layer.weight is weight and isinstance(weight, torch.nn.Parameter)
    assert weight.requires_grad and weight.tag == "mine"  # type: ignore[attr-defined]
    assert torch.equal(weight.grad, torch.ones(2, 3))
    assert weight.data_ptr() == stack[1].data_ptr() and _torch.impl_id(weight) != 0
    before = stack._version
    with torch.no_grad():
        weight.add_(1)
    assert stack._version > before and torch.all(stack[1] == 1)
    out = layer(torch.rand(5, 3, requires_grad=True))  # a live graph holds the weight
    assert not _torch.share_version(weight, stack[2])
    del out
    assert _torch.share_version(weight, stack[2])


# ---- a world that heals: members kept, RRefs crossing without torch's fork messages ----


def forks_here() -> int:
    return int(torch._C._distributed_rpc._rref_context_get_debug_info()["num_forks"])


def value_by_id(owner: int, created_on: int, local_id: int) -> object:
    """On the owner: its own object, found by id (no fork, no message)."""
    return _torch.owner_view(owner, (created_on, local_id), _torch.PY_OBJECT).local_value()


def fork_for_another(created_on: int, local_id: int) -> tuple[object, ...]:
    """On the owner: a fork of its RRef made for another worker, registered now."""
    own = _torch.owner_view(_torch.own_id(), (created_on, local_id), _torch.PY_OBJECT)
    return _torch.fork_from_owner(own)


def adopt_and_read(data: tuple[object, ...]) -> object:
    rref = _torch.adopt_fork(data)
    return rref.to_here()


def test_rrefs_found_by_id_and_forks_made_by_their_owner(world: asyncrpc.Context) -> None:
    rref = _torch.remote("worker1", str.upper, args=("held",))
    assert rref.to_here() == "HELD"
    created_on, local_id = _torch.rref_id(rref)
    assert (created_on, _torch.own_id()) == (0, 0)
    forks = _torch.rpc_sync("worker1", forks_here)
    # The owner finds its own object by id: nothing forked, nothing to confirm.
    assert _torch.rpc_sync("worker1", value_by_id, args=(1, created_on, local_id)) == "HELD"
    assert _torch.rpc_sync("worker1", forks_here) == forks
    # A fork the owner makes for worker2 is registered at once; worker2 takes it in
    # without a message, and gives it back when it drops it.
    data = _torch.rpc_sync("worker1", fork_for_another, args=(created_on, local_id))
    assert (data[0], data[5], data[6]) == (1, 1, _torch.PY_OBJECT)  # owner, parent, type
    assert _torch.rpc_sync("worker1", forks_here) == forks + 1
    assert _torch.rpc_sync("worker2", adopt_and_read, args=(data,)) == "HELD"
    deadline = time.monotonic() + 10
    while _torch.rpc_sync("worker1", forks_here) != forks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _torch.rpc_sync("worker1", forks_here) == forks


def test_the_agent_knows_every_member_and_a_pipe_to_nobody_is_no_error(
    world: asyncrpc.Context,
) -> None:
    assert _torch.known_ids() == set(range(world.world_size))
    assert _torch.worker_info("worker2").id == 2
    _torch.close_pipe("no-such-worker")  # not known here: nothing to close


def listener_found() -> bool:
    from asyncrpc._core._torch import _listener

    port = _listener.port()
    return port is not None and _listener.find(port) is not None


def test_the_agents_listening_socket_is_found_from_torchs_published_address(
    world: asyncrpc.Context,
) -> None:
    # Where torch publishes it ("addrs/<name>" in the agent's store, "uv://host:port"):
    # a world that heals watches that socket (tests/test_heal_paths.py closes one).
    assert listener_found()
    assert asyncrpc.rpc_sync("worker1", listener_found) is True


def test_rref_pickling_is_patched_while_installed(world: asyncrpc.Context) -> None:
    pickler = torch.distributed.rpc.internal._internal_rpc_pickler
    receiver = vars(torch.distributed.rpc.internal._InternalRPCPickler)["_py_rref_receiver"]
    assert "_py_rref_reducer" in vars(pickler)  # asyncrpc's, over torch's method
    assert receiver.__func__.__wrapped__ is not None  # asyncrpc's, wrapping torch's
    # Put back by the last shutdown: tests/programs/side_effects.py compares both.


def test_torchs_texts_for_unknown_members_and_lost_objects_are_recognised() -> None:
    for text, kind in [
        ("name:worker1,rank:172 could not find destination name worker4", "unreachable"),
        ("name:worker1,rank:3 could not find destination url for name worker4", "unreachable"),
        ("Error on Node 1: could not find destination id 3", "lost"),
        ("Error on Node 2: ObjectLostError: the object ... lived on worker 'worker3'", "lost"),
        (
            "this->threadPool_.inThreadPool() INTERNAL ASSERT FAILED at tensorpipe_agent.cpp:862,"
            " please report a bug to PyTorch. Future marked complete from outside the thread pool",
            "unreachable",
        ),
    ]:
        assert _torch.failure_kind(RuntimeError(text)) == kind, text


def value_by_id_of_any_type(owner: int, created_on: int, local_id: int) -> object:
    return _torch.owner_view(owner, (created_on, local_id), "").local_value()


def test_an_owner_finds_its_object_by_id_whatever_its_type(world: asyncrpc.Context) -> None:
    # torch's refusal of a wrong type names the right one (a builtin's value is a Tensor).
    rref = _torch.remote("worker1", torch.ones, args=((2,),))
    assert torch.equal(rref.to_here(), torch.ones(2))
    ids = (1, *_torch.rref_id(rref))
    assert torch.equal(_torch.rpc_sync("worker1", value_by_id_of_any_type, args=ids),
                       torch.ones(2))  # fmt: skip


def test_a_dead_member_leaves_the_group_list_under_the_groups_token() -> None:
    # torch's joins read the list and write it back whole, holding the token: an edit
    # made beside one would be written over (the dead member listed again, for good).
    store = torch.distributed.HashStore()
    store.set("names/_ALL_WORKER_INFOS", "worker0-0,worker1-1,worker2-2,worker1:5-5,")
    store.set("RpcGroupManagementToken", "Token_for_worker1:5_join")  # it died joining
    dead = {"worker1:5", "worker2"}.__contains__
    _torch.forget_member(store, "worker2", 2, dead, timeout=5)
    assert store.get("names/_ALL_WORKER_INFOS") == b"worker0-0,worker1-1,worker1:5-5,"
    assert store.get("Token_for_worker1:5_join") == b"Done"  # its waiters go on
    assert store.get("RpcGroupManagementToken") == b""  # released once done
    # A live member's join in progress is waited for, not broken.
    store.set("RpcGroupManagementToken", "Token_for_worker0_join")
    release = threading.Timer(0.3, store.set, args=("RpcGroupManagementToken", ""))
    release.start()
    started = time.monotonic()
    _torch.forget_member(store, "worker1:5", 5, dead, timeout=5)
    assert time.monotonic() - started >= 0.25
    assert store.get("names/_ALL_WORKER_INFOS") == b"worker0-0,worker1-1,"
    store.set("RpcGroupManagementToken", "Token_for_worker0_join")  # stuck: taken in the end
    _torch.forget_member(store, "worker1", 1, dead, timeout=0.2)
    assert store.get("names/_ALL_WORKER_INFOS") == b"worker0-0,"


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_a_join_that_meets_a_dead_member_fails_at_once() -> None:
    # torch's own failed join waits 20 s for its own token, then hangs in its
    # shutdown (tests/programs/failed_join.py torch); a replacement joins this way.
    result = run_program("python", str(PROGRAMS / "failed_join.py"), "fast", timeout=100)
    found = re.search(r"^failed join: (\{.*\})$", result.stdout, re.MULTILINE)
    assert found is not None, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    seen = json.loads(found.group(1))
    assert "connection refused" in seen["error"].lower(), seen  # torch's own failure, raised
    assert seen["seconds"] < 5.0, seen  # not the store's 20 s


def test_shared_storages_map_the_same_memory_and_copy_the_rest() -> None:
    import torch

    from asyncrpc._core import _torch

    plain = torch.arange(6.0)
    grad = torch.ones(2, requires_grad=True)
    value = {"w": plain[2:], "grad": grad, "n": 3}
    back = _torch.loads_shared(_torch.dumps_shared(value))
    assert torch.equal(back["w"], plain[2:]) and back["n"] == 3
    assert back["w"].is_shared() and plain.is_shared()  # the storage moved once, in place
    plain[3] = 42.0  # one memory: a write on one side is seen on the other
    assert back["w"][1] == 42.0
    assert back["grad"].requires_grad and not back["grad"].is_shared()  # pickled as usual
    assert _torch.host_key() == _torch.host_key() != ""
