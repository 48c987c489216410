"""Ray as a peer in the benchmarks: installed or not, and started on loopback only.

On Linux Ray's `_node_ip_address` alone still leaves servers on every
interface, so RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set when this module is
imported, before anything imports Ray; `start` reports where Ray's new
listening sockets are. Ray is optional (`pip install 'asyncrpc[bench]'`).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

__all__ = ("installed", "sockets", "start")

# What the last `start` found: Ray's new listening sockets, and those off loopback.
sockets: dict[str, object] = {}


def installed() -> bool:
    """True when Ray can be imported."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def start() -> bool:
    """Start a local Ray on 127.0.0.1 (2 CPUs); False, with a line why, without Ray."""
    if not installed():
        print("Ray rows skipped: Ray is not installed (pip install 'asyncrpc[bench]')")
        return False
    import ray

    before = _listeners()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )
    opened = _listeners() - before
    off = sorted(f"{a}:{p}" for a, p in opened if not _is_loopback(a))
    where = "all on loopback" if not off else f"{len(off)} off loopback: {off[:4]}"
    sockets.update(opened=len(opened), off_loopback=off)
    print(f"Ray's listening sockets: {len(opened)}, {where}", flush=True)
    return True


def _is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def _listeners() -> set[tuple[str, int]]:
    """Every listening TCP socket of this machine: (address, port)."""
    import ipaddress

    found = set()
    for name, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            raw, port = local.split(":")
            packed = bytes.fromhex(raw)
            words = [packed[i : i + 4][::-1] for i in range(0, len(packed), 4)]  # host order
            address = ipaddress.ip_address(b"".join(words)) if size == 16 else None
            if address is None:
                address = ipaddress.ip_address(packed[::-1])
            found.add((str(address), int(port, 16)))
    return found
