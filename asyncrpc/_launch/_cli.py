"""`asyncrpc-launch`: torchrun with asyncrpc's safe defaults.

The launcher is torchrun itself (`torch.distributed.run`), run in-process
with one change: its default static rendezvous is replaced by the
`asyncrpc` backend, whose store listens only on the master address
(127.0.0.1 on one machine) instead of every interface::

    asyncrpc-launch --nproc-per-node 3 script.py
      `-> torchrun --rdzv-backend asyncrpc --rdzv-endpoint 127.0.0.1:0 ... script.py
            agent: store bound to 127.0.0.1:<free port> (node rank 0 only)
            `-- workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT) -> asyncrpc.run joins

The same backend is registered for plain torchrun through the
`torchrun.handlers` entry point: `torchrun --rdzv-backend asyncrpc ...`.

What differs from torchrun besides: every argument is checked before
anything starts (one line naming the value and what is allowed, exit 2);
the workers end with the launcher, SIGKILL included (`_parent`); a signal
that stops the launcher (Ctrl-C) is one line and exit status 128 + signal;
a failed world ends with torch's summary, whose root cause is the worker
that raised first (`_torch.watch_agent_failures`), without the launcher's traceback.

`--restart worker` does without torch's agent, which can only restart the
whole worker group: each launcher is its own small supervisor (`_nodes`)
that replaces a dead worker of its node in place, while the others run on.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from .._core import _net, _rendezvous
from . import _nodes, _parent
from ._launched import RESTART_VARIABLE

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ("BACKEND", "build_args", "main", "rendezvous_handler")

BACKEND = "asyncrpc"
_DEFAULT_TIMEOUT_S = 600

_EPILOG = """\
Every torchrun option works as in torchrun. What differs:
  * on one machine (--nnodes 1, the default) the rendezvous store and the
    workers' RPC listen on 127.0.0.1 only, on a free port;
  * across machines (--nnodes N) node 0 hosts the store on --master-addr
    (an address of that host, on the private network), and every node
    binds RPC to --interface, or to the interface that reaches the master;
  * OMP/intra-op threads default to cores // nproc-per-node; an
    OMP_NUM_THREADS you set is kept;
  * the workers end with the launcher, even when it is killed (SIGKILL);
  * Ctrl-C prints one line and exits 130;
  * --restart worker --max-restarts K replaces a worker that dies in place,
    under its name and rank, while every other worker keeps running with its
    state (asyncrpc.run worlds only; K bounds the replacements of the world);
  * --elastic lets workers add and remove workers while the world runs
    (asyncrpc.add_workers, remove_workers; --max-world-size M bounds it),
    --join HOST:PORT adds this machine's workers to such a world, and
    SIGTERM to a launcher other than node 0 makes its workers leave.

examples:
  asyncrpc-launch --nproc-per-node 3 examples/ring.py
  asyncrpc-launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 \\
      --master-port 29500 --nproc-per-node 4 --interface eth1 train.py
  asyncrpc-launch --join 10.0.0.1:29500 --nproc-per-node 4 train.py
"""


@functools.cache
def _handler_class() -> type[Any]:
    # torch's rendezvous package loads the `torchrun.handlers` entry points while
    # it initializes, and that entry point is this module: import it lazily.
    from .._core import _torch

    return _torch.bound_static_rendezvous(
        BACKEND, _rendezvous.host_store, _rendezvous.client_store
    )


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if "rank" not in params.config:
        raise ValueError(
            f"the {BACKEND!r} rendezvous needs the node rank: add --rdzv-conf rank=R "
            f"(asyncrpc-launch adds it from --node-rank)"
        )
    addr, port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    if port < 0:
        raise ValueError(
            f"the {BACKEND!r} rendezvous needs a port in --rdzv-endpoint HOST:PORT, "
            f"got {params.endpoint!r}"
        )
    from .._core import _liveness, _torch

    rank = int(params.config["rank"])
    timeout = int(params.config.get("timeout", _DEFAULT_TIMEOUT_S))
    handler = _handler_class()(addr, port, rank, params.max_nodes, params.run_id, timeout)
    # This process is the agent: let it name the workers it sees die, while the
    # rendezvous lasts (torch's launcher shuts it down when the agent ends).
    handler.on_shutdown = _torch.watch_agent_failures(_liveness.report_exits)
    # The workers it starts take this process's environment: they die with it (_parent).
    os.environ[_parent.LAUNCHER_VARIABLE] = str(os.getpid())
    return handler  # type: ignore[no-any-return]


def rendezvous_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point for torchrun's `torchrun.handlers` group."""
    return _create_handler


class _Parser(argparse.ArgumentParser):
    """torchrun's options; a mistake is one line (torchrun's usage alone is dozens)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; `{self.prog} --help` lists every option\n")


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = _Parser(
        prog="asyncrpc-launch",
        description="Launch an asyncrpc (or any torch.distributed) script with torchrun, "
        "listening on loopback only unless several machines are asked for.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[get_args_parser()],
        add_help=False,  # torchrun's parser brings -h
    )
    parser.add_argument(
        "--restart",
        choices=("world", "worker"),
        default="world",
        help="what --max-restarts restarts when a worker fails: the whole world (default, "
        "torchrun's agent) or only that worker, in place (asyncrpc.run worlds)",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="members may add and remove workers while the world runs "
        "(asyncrpc.add_workers, remove_workers), and nodes may join (--join) and leave "
        "(SIGTERM to their launcher); implies --restart worker",
    )
    parser.add_argument(
        "--max-world-size",
        type=int,
        default=None,
        help="--elastic: the most workers the world may have at once (default: no bound)",
    )
    parser.add_argument(
        "--join",
        default=None,
        metavar="HOST:PORT",
        help="add this node's --nproc-per-node workers to a running --elastic world, whose "
        "node 0 launcher listens on HOST:PORT",
    )
    parser.add_argument(
        "--devices",
        default=None,
        help="the workers' CUDA devices, as asyncrpc.init(devices=...): 'cuda' gives each "
        "worker cuda:(LOCAL_RANK %% GPUs) and maps it to every other worker's, so CUDA "
        "tensors move between them; 'cuda:K' (or K) for one device; 'cpu' (default) for none",
    )
    parser.add_argument(
        "--interface",
        default=None,
        help="network interface the workers' RPC binds to (default: lo on one machine, "
        "else the interface that reaches --master-addr)",
    )
    return parser


def build_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse launcher arguments into torchrun's namespace, with asyncrpc's defaults applied.

    A value torchrun would fail on, or crash on, exits here with status 2 and
    one line that names the value and what is allowed.
    """
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.join is not None:
        args.elastic = True
        args.rdzv_endpoint = args.join
    if args.elastic:
        args.restart = "worker"  # an elastic world's launchers are asyncrpc's own
    try:
        _check(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.restart == "worker":
        if args.join is None:  # --join names node 0's store, which is placed already
            _place_store(args)
        _check_endpoint(args.rdzv_endpoint, parser)
        if args.join is None:
            _warn_if_unreachable(args.rdzv_endpoint, args.nnodes)
        return args
    if args.rdzv_backend == "static" or args.standalone:
        _, max_nodes = _node_range(args.nnodes)
        single = max_nodes == 1
        host = args.master_addr if not single or args.master_addr != "127.0.0.1" else "127.0.0.1"
        if single and not _net.is_loopback(host):
            host = "127.0.0.1"
        port = args.master_port if args.master_port is not None else (0 if single else 29500)
        args.standalone = False
        args.rdzv_backend = BACKEND
        args.rdzv_endpoint = args.rdzv_endpoint or f"{host}:{port}"
        conf = f"rank={args.node_rank}"
        args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
        args.node_rank = 0  # now carried by rdzv_conf; torchrun warns it is ignored otherwise
    if args.rdzv_backend == BACKEND:
        _check_endpoint(args.rdzv_endpoint, parser)
        _warn_if_unreachable(args.rdzv_endpoint, args.nnodes)
    return args


def _place_store(args: argparse.Namespace) -> None:
    """`--restart worker`: where node 0's launcher hosts the store (the node rank stays as is)."""
    _, max_nodes = _node_range(args.nnodes)
    single = max_nodes == 1
    host = args.master_addr
    if single and not args.elastic and not _net.is_loopback(host):
        host = "127.0.0.1"  # an elastic world's other nodes may join it at --master-addr
    port = args.master_port if args.master_port is not None else (0 if single else 29500)
    args.rdzv_backend = BACKEND
    args.rdzv_endpoint = args.rdzv_endpoint or f"{host}:{port}"
    args.standalone = False


_NPROC_ALLOWED = (
    "a whole number above 0, 'auto' or 'cpu' (one worker per CPU), or 'gpu' or 'xpu' "
    "(one per device) on a machine that has them"
)


def local_workers(nproc_per_node: str) -> int:
    """How many workers --nproc-per-node starts on this machine; ValueError if none or unknown."""
    from torch.distributed.run import determine_local_world_size

    value = str(nproc_per_node)
    try:
        count = int(determine_local_world_size(value))
    except (ValueError, RuntimeError, AttributeError) as exc:
        raise ValueError(
            f"--nproc-per-node must be {_NPROC_ALLOWED}, got {value!r} ({exc})"
        ) from exc
    if count < 1:
        raise ValueError(f"--nproc-per-node must be {_NPROC_ALLOWED}, got {value!r}")
    return count


def _check(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first argument torchrun cannot run with."""
    local_workers(args.nproc_per_node)
    _, max_nodes = _node_range(args.nnodes)
    if not 0 <= args.node_rank < max_nodes:
        raise ValueError(
            f"--node-rank must be 0..{max_nodes - 1} for --nnodes {args.nnodes}, "
            f"got {args.node_rank}"
        )
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        raise ValueError(f"--master-port must be a port, 0..65535, got {args.master_port}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if not (math.isfinite(args.monitor_interval) and args.monitor_interval > 0):
        raise ValueError(
            f"--monitor-interval must be a number of seconds above 0, got {args.monitor_interval}"
        )
    if args.max_world_size is not None and (not args.elastic or args.max_world_size < 1):
        raise ValueError(
            f"--max-world-size bounds an elastic world: pass it with --elastic, as a count "
            f"of workers >= 1, got {args.max_world_size}"
        )
    if args.join is not None and (_node_range(args.nnodes) != (1, 1) or args.node_rank != 0):
        raise ValueError(
            f"--join gives this node its number from the running world: leave --nnodes and "
            f"--node-rank out, got --nnodes {args.nnodes} --node-rank {args.node_rank}"
        )
    if args.restart == "worker":
        _check_worker_restart(args)
    if args.devices is not None:
        from .._core import _devices

        _devices.check_flag(args.devices, changing=args.restart == "worker")
    names = sorted(name for _, name in socket.if_nameindex())
    if args.interface is not None and args.interface not in names:
        raise ValueError(
            f"--interface must be a network interface of this machine, one of {names}, "
            f"got {args.interface!r}"
        )


_AGENT_ONLY = (
    ("run_path", "--run-path", False),
    ("log_dir", "--log-dir", None),
    ("redirects", "--redirects", "0"),
    ("tee", "--tee", "0"),
)


def _check_worker_restart(args: argparse.Namespace) -> None:
    """Raise ValueError for what `--restart worker` (no torch agent) cannot do."""
    least, most = _node_range(args.nnodes)
    if least != most:
        raise ValueError(
            f"--restart worker needs a fixed number of machines, --nnodes N, got "
            f"{args.nnodes!r}: the world keeps its size while workers are replaced"
        )
    if args.rdzv_backend not in ("static", BACKEND):
        raise ValueError(
            f"--restart worker hosts the store on node 0's launcher (--master-addr/--master-port "
            f"or --rdzv-endpoint HOST:PORT), so --rdzv-backend must be left out or be "
            f"{BACKEND!r}, got {args.rdzv_backend!r}"
        )
    for field, flag, default in _AGENT_ONLY:
        if getattr(args, field) != default:
            raise ValueError(
                f"{flag} is an option of torch's agent, which --restart worker does not use "
                f"(the workers write to the launcher's own output), got "
                f"{flag} {getattr(args, field)!r}; leave it out, or use --restart world"
            )
    if args.max_restarts < 1 and not args.elastic:
        raise ValueError(
            f"--restart worker replaces dead workers at most --max-restarts times, got "
            f"--max-restarts {args.max_restarts}; pass --max-restarts K with K >= 1"
        )


def _check_endpoint(endpoint: str, parser: argparse.ArgumentParser) -> None:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        _, port = parse_rendezvous_endpoint(endpoint.strip(), -1)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        parser.error(
            f"--rdzv-endpoint must be HOST:PORT with a port 0..65535 (node 0's address), "
            f"got {endpoint!r}"
        )


def _warn_if_unreachable(endpoint: str, nnodes: str) -> None:
    host = endpoint.rpartition(":")[0].strip("[]")
    if _node_range(nnodes)[1] > 1 and _net.is_loopback(host):
        print(
            f"asyncrpc-launch: warning: --nnodes {nnodes} but the rendezvous host {host!r} "
            f"is a loopback address here, so only launchers on this machine can join; "
            f"on several machines pass node 0's private address (--rdzv-endpoint "
            f"10.0.0.1:29500 or --master-addr 10.0.0.1)",
            file=sys.stderr,
        )


def _node_range(nnodes: str) -> tuple[int, int]:
    low, _, high = str(nnodes).partition(":")
    try:
        least, most = int(low), int(high or low)
    except ValueError:
        least = most = 0
    if not 1 <= least <= most:
        raise ValueError(
            f"--nnodes must be a whole number of machines above 0, or MIN:MAX with "
            f"1 <= MIN <= MAX, got {nnodes!r}"
        )
    return least, most


def _set_child_env(args: argparse.Namespace) -> None:
    """The workers' environment: the interface, the launcher's pid and restart, OMP_NUM_THREADS.

    OMP_NUM_THREADS: one the user set is kept; otherwise cores // local
    workers (torchrun would set 1), which `asyncrpc.run` keeps as it keeps any.
    """
    if args.interface:
        os.environ["ASYNCRPC_INTERFACE"] = args.interface
    if args.devices is not None:
        os.environ["ASYNCRPC_DEVICES"] = args.devices  # _devices.VARIABLE
    os.environ[_parent.LAUNCHER_VARIABLE] = str(os.getpid())
    os.environ[RESTART_VARIABLE] = args.restart  # a run(restart=...) must agree
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // local_workers(args.nproc_per_node)))


class _StopNotes(logging.Filter):
    """Drops torch's notes on the signal that stops the launcher: `main` says it in one line."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith("Received %s death signal"):
            self.stopping = True
            return False
        return not (self.stopping and text.startswith("Sending process %s closing signal"))


_TORCH_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                  "torch.distributed.elastic.multiprocessing.api")  # fmt: skip


@contextmanager
def _one_line_on_signals() -> Iterator[None]:
    """A signal that stops torch's agent (Ctrl-C, SIGTERM) ends the launcher with one line.

    torch's agent stops the workers with the same signal and raises; this
    prints what happened and exits with 128 + the signal, as a shell expects
    (Ctrl-C: 130). A worker that fails ends it with torch's summary, not a traceback.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    notes = _StopNotes()
    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    for logger in loggers:
        logger.addFilter(notes)
    try:
        yield
    except (SignalException, KeyboardInterrupt) as stop:
        number = getattr(stop, "sigval", signal.SIGINT)
        what = "interrupted (Ctrl-C)" if number == signal.SIGINT else f"ended by {number.name}"
        print(f"asyncrpc-launch: {what}; the workers were stopped", file=sys.stderr, flush=True)
        raise SystemExit(128 + int(number)) from None
    except ChildFailedError as failed:
        print(failed, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        for logger in loggers:
            logger.removeFilter(notes)


def _check_script(args: argparse.Namespace) -> None:
    """Exit 2 with one line if the script to run is not a file (before any worker starts).

    Otherwise every worker fails at its start, and a world that heals
    would start them again until `--max-restarts` is spent.
    """
    if args.module or args.no_python or os.path.isfile(args.training_script):
        return
    _parser().error(
        f"the script {args.training_script!r} is not a file (looked for from {os.getcwd()}); "
        f"pass the path of a Python script, or -m MODULE"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of `asyncrpc-launch`."""
    from torch.distributed.run import run

    from .._core import _torch

    with _one_line_on_signals():
        args = build_args(sys.argv[1:] if argv is None else argv)
        _check_script(args)
        if args.restart == "worker":
            _set_child_env(args)
            raise SystemExit(_nodes.run(args, local_workers(args.nproc_per_node)))
        unregister = _torch.register_rendezvous(BACKEND, _create_handler)
        _set_child_env(args)
        try:
            run(args)  # type: ignore[no-untyped-call]
        finally:
            unregister()


if __name__ == "__main__":
    main()
