"""torchrun's side, in the launcher's process: its rendezvous registry and its elastic agent.

asyncrpc registers its own rendezvous backend, binds torch's static TCP
rendezvous to a store it makes (on the master address only), and has the
agent tell the world's store of every local worker that failed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch._C._distributed_c10d import PrefixStore

from ._versions import require

__all__ = ("bound_static_rendezvous", "register_rendezvous", "watch_agent_failures")


def register_rendezvous(name: str, create: Callable[..., Any]) -> Callable[[], None]:
    """Register a torchrun rendezvous backend; returns how to unregister it."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as handlers

    require({"rendezvous_handler_registry._registry": lambda: handlers._registry})
    registry: dict[str, Any] = handlers._registry
    if name in registry:
        return lambda: None
    handlers.register(name, create)

    def unregister() -> None:
        registry.pop(name, None)

    return unregister


def bound_static_rendezvous(
    backend: str,
    host_store: Callable[[str, int, float], Any],
    client_store: Callable[[str, int, float], Any],
) -> type[Any]:
    """torch's static TCP rendezvous, with the store made by `host_store`/`client_store`.

    It fills torch's private `_store` slot before torch would make its own
    store (which listens on every interface). A handler's `on_shutdown` runs
    when the agent shuts the rendezvous down.
    """
    from torch.distributed.elastic.rendezvous import RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
    )

    class BoundStaticRendezvous(StaticTCPRendezvous):
        """torch's static rendezvous, with the store bound to the master address only."""

        on_shutdown: Callable[[], None] | None = None

        def get_backend(self) -> str:
            return backend

        def next_rendezvous(self) -> RendezvousInfo:
            require({"StaticTCPRendezvous._store": lambda: "_store" in vars(self) or None})
            if self._store is None:
                seconds = self.timeout.total_seconds()
                if self.rank == 0:
                    store = host_store(self.master_addr, self.master_port, seconds)
                    self.master_port = store.port
                else:
                    store = client_store(self.master_addr, self.master_port, seconds)
                self._store = store
            info = RendezvousStoreInfo(self.master_addr, self.master_port)
            store_view = PrefixStore(self.run_id, self._store)
            return RendezvousInfo(store_view, self.rank, self.world_size, info)

        def shutdown(self) -> bool:
            if self.on_shutdown is not None:
                self.on_shutdown()
            return bool(super().shutdown())

    return BoundStaticRendezvous


def watch_agent_failures(
    report: Callable[[Any, str, list[tuple[int, int, int]], list[int]], None],
) -> Callable[[], None]:
    """Have torchrun's agent call `report(store, attempt, [(rank, pid, exitcode)], elsewhere)`.

    `elsewhere` lists the ranks of the world's workers on other nodes.
    Returns how to stop. The agent learns every local worker's exit (signal
    included) first; this wraps its private `_monitor_workers` so the
    world's store hears of it too.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    require({"LocalElasticAgent._monitor_workers": lambda: vars(LocalElasticAgent).get(
        "_monitor_workers")})  # fmt: skip
    original = LocalElasticAgent._monitor_workers
    if getattr(original, "_asyncrpc", False):
        return lambda: None

    def monitor(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        spec = worker_group.spec
        store = getattr(spec.rdzv_handler, "_store", None)
        if result.is_failed() and store is not None:
            attempt = str(spec.max_restarts - self._remaining_restarts)
            failed = [(rank, f.pid, f.exitcode) for rank, f in result.failures.items()]
            workers = worker_group.workers
            here = {w.global_rank for w in workers}
            size = workers[0].world_size if workers else 0
            report(store, attempt, failed, [r for r in range(size) if r not in here])
        if result.is_failed():
            _root_cause_first(result.failures)
        return result

    monitor._asyncrpc = True  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]

    def stop() -> None:
        if LocalElasticAgent.__dict__.get("_monitor_workers") is monitor:
            LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]

    return stop


def _root_cause_first(failures: dict[int, Any]) -> None:
    """Order torchrun's failures (rank -> ProcessFailure) so its "Root Cause" is the real one.

    torch names the failure with the earliest timestamp, in whole seconds,
    and the first in order on a tie: the lowest rank, often one stopped
    because another failed. A worker whose `main` raised first wrote an error
    file (`_supervisor`); those go first, earliest first, the rest keep their order.
    """
    recorded = {r: f.timestamp for r, f in failures.items() if os.path.isfile(f.error_file)}
    if recorded:
        ordered = sorted(failures.items(), key=lambda item: recorded.get(item[0], float("inf")))
        failures.clear()
        failures.update(ordered)
