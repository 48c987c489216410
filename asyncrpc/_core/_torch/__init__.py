"""The torch boundary: every private torch name, every match on torch's text, every patch.

`torch.distributed.rpc` is in maintenance mode and will not grow the hooks
asyncrpc needs, so where asyncrpc reaches past torch's public API it does so
in this package and nowhere else. tests/test_torch_boundary.py checks each
item against the installed torch; `install` checks the ones it patches and
names any that is missing, with the torch versions asyncrpc is tested with.

    asyncrpc ──> _torch ──> torch._C._distributed_rpc (agent, options, the UDF send)
                        ──> torch._C.Future (_set_unwrap_func; patched: __await__,
                            wait/value/then/add_done_callback), torch._C._collect_all
                        ──> PyRRef (_get_future; patched: to_here, local_value)
                        ──> rendezvous registries, torchrun's agent and static rendezvous
                        ──> torch's error texts (timeout, transport, pickle)

Process-wide patches are installed by `install` when a world first needs
them, never at import, and `uninstall` puts back exactly what was there.
What the boundary keeps for a world (its patches, its notes on Futures, the
kinds of RRefs, the call being pickled, the watched Futures) lives in that
world's parts (`_runtime`), so the world's end puts torch back and forgets it.

Its modules, lowest first (each imports only those before it, `_errors` and
`_runtime`):

    _versions    the torch versions tested; `require`, the check a private name exists
    _originals   torch's own verbs and Future methods, bound before any patch
    _texts       torch's failure texts (`failure_kind`), its remote exceptions, its warnings
                 of departures (`pipe_warning`, `rref_leak`)
    _process     torch's RPC threads, inter-op pool, profiler, TorchScript warnings
    _modules     nn.Module's and tensors' private tables, hooks and counters (`_fanout`)
    _launcher    torchrun's rendezvous registry, static rendezvous and elastic agent
    _agent       the RPC agent: its workers, store, group members, shutdown steps
    _static      a static group's agent started without torch's Gloo group (`start_static`)
    _listener    whether this process's TensorPipe listener still accepts (`watch_listener`)
    _patches     `Hooks`, the `Patches` part (each patch, put back), `install_await`
    _notes       tags, guards, combined Futures, cancellers; `cancel`
    _unread      failures nobody read (`watch_unread`)
    _sending     torch's UDF send and pickler; the callee of the call being pickled
    _shared      CPU tensors' storages shared by name with processes of one machine
    _releases    the RRefs of a world that heals, dropped on one thread (torch's lock order)
    _rrefs       RRef ids, owners, kinds, forks without messages; the pickling patch
    _reads       the patched Future and RRef reads: carried failures, torch's named
    _install     `install` (checked first) and `uninstall`
"""

from __future__ import annotations

from ._agent import (
    PrefixStore,
    Store,
    TCPStore,
    WorkerInfo,
    agent_running,
    agent_store,
    agent_threads,
    backend_options,
    close_pipe,
    current_agent,
    default_timeout,
    failing_fast,
    forget_member,
    group_key_prefix,
    known_ids,
    own_id,
    own_name,
    release_user_rrefs,
    root_store,
    serving,
    stop_serving,
    store_address,
    worker_info,
    worker_infos,
)
from ._install import install, uninstall
from ._launcher import bound_static_rendezvous, register_rendezvous, watch_agent_failures
from ._listener import unwatch as unwatch_listener
from ._listener import watch as watch_listener
from ._modules import (
    any_tensor_hooks,
    call_hook_tables,
    global_call_hook_tables,
    hook_registrar,
    hook_tables,
    impl_id,
    is_compiled,
    is_parametrized,
    module_tables,
    share_version,
    storage_shared,
    tensor_hooks,
    tensor_tables,
    tensor_version,
)
from ._notes import (
    cancel,
    check_guard,
    combine,
    guard_reads,
    parts_of,
    set_canceller,
    tag_future,
    tag_of,
)
from ._originals import (
    UNSET_TIMEOUT,
    FutureType,
    add_callback,
    outcome,
    remote,
    rpc_async,
    rpc_sync,
)
from ._patches import Hooks, install_await
from ._process import (
    interop_pool_started,
    is_rpc_thread,
    profiler_config,
    profiling,
    quiet_torchscript,
)
from ._reads import set_unwrap
from ._rrefs import (
    PENDING,
    PY_OBJECT,
    PyRRef,
    adopt_fork,
    check_received,
    created,
    drop_fork,
    fork_from_owner,
    note_kind,
    owner_view,
    rref_future,
    rref_id,
    rref_kind,
    rref_owner,
)
from ._sending import (
    ASYNC_MARK,
    async_target,
    collect_for_wait_all,
    deserialize,
    is_builtin,
    keep_until_done,
    mark_async,
    send_python,
    send_torch,
    sending_to,
    serialize,
)
from ._shared import dumps_shared, host_key, loads_shared, snapshot_shared
from ._static import start_static
from ._texts import (
    RemoteException,
    failure_kind,
    pipe_warning,
    raise_remote_exception,
    refused,
    remote_exception,
    rref_leak,
)
from ._unread import watch_unread
from ._versions import TESTED_TORCH

__all__ = (
    "ASYNC_MARK",
    "PENDING",
    "PY_OBJECT",
    "TESTED_TORCH",
    "UNSET_TIMEOUT",
    "FutureType",
    "Hooks",
    "PrefixStore",
    "PyRRef",
    "RemoteException",
    "Store",
    "TCPStore",
    "WorkerInfo",
    "add_callback",
    "adopt_fork",
    "agent_running",
    "agent_store",
    "agent_threads",
    "any_tensor_hooks",
    "async_target",
    "backend_options",
    "bound_static_rendezvous",
    "call_hook_tables",
    "cancel",
    "check_guard",
    "check_received",
    "close_pipe",
    "collect_for_wait_all",
    "combine",
    "created",
    "current_agent",
    "default_timeout",
    "deserialize",
    "drop_fork",
    "dumps_shared",
    "failing_fast",
    "failure_kind",
    "forget_member",
    "fork_from_owner",
    "global_call_hook_tables",
    "group_key_prefix",
    "guard_reads",
    "hook_registrar",
    "hook_tables",
    "host_key",
    "impl_id",
    "install",
    "install_await",
    "interop_pool_started",
    "is_builtin",
    "is_compiled",
    "is_parametrized",
    "is_rpc_thread",
    "keep_until_done",
    "known_ids",
    "loads_shared",
    "mark_async",
    "module_tables",
    "note_kind",
    "outcome",
    "own_id",
    "own_name",
    "owner_view",
    "parts_of",
    "pipe_warning",
    "profiler_config",
    "profiling",
    "quiet_torchscript",
    "raise_remote_exception",
    "refused",
    "register_rendezvous",
    "release_user_rrefs",
    "remote",
    "remote_exception",
    "root_store",
    "rpc_async",
    "rpc_sync",
    "rref_future",
    "rref_id",
    "rref_kind",
    "rref_leak",
    "rref_owner",
    "send_python",
    "send_torch",
    "sending_to",
    "serialize",
    "serving",
    "set_canceller",
    "set_unwrap",
    "share_version",
    "snapshot_shared",
    "start_static",
    "stop_serving",
    "storage_shared",
    "store_address",
    "tag_future",
    "tag_of",
    "tensor_hooks",
    "tensor_tables",
    "tensor_version",
    "uninstall",
    "unwatch_listener",
    "watch_agent_failures",
    "watch_listener",
    "watch_unread",
    "worker_info",
    "worker_infos",
)
