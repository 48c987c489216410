"""Addresses and listening sockets: where a world listens and how it binds.

A single-node world binds everything to loopback. torch's own TCP store
binds every interface, so asyncrpc binds the socket itself and hands the
file descriptor to the store::

    listen_on("127.0.0.1", port) --fd--> TCPStore(master_listen_fd=fd)
    interface_for("127.0.0.1") == "lo" --> TP_SOCKET_IFNAME=lo (TensorPipe)
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct

from ._errors import PortInUseError

__all__ = ["interface_for", "is_loopback", "listen_on", "local_address_towards"]

_SIOCGIFADDR = 0x8915


def is_loopback(host: str) -> bool:
    """True when `host` (a name or an address) resolves to a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = struct.pack("256s", ifname.encode()[:15])
            raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, packed)
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def interface_for(address: str) -> str | None:
    """The name of the local network interface that holds IPv4 `address`."""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    if ipaddress.ip_address(address).is_loopback:
        return interface_for("127.0.0.1") if address != "127.0.0.1" else None
    return None


def local_address_towards(host: str, port: int) -> str:
    """The local IPv4 address the kernel would use to reach `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port or 9))
        return str(probe.getsockname()[0])


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` and listening; port 0 picks a free one."""
    address = socket.gethostbyname(host)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(host, port) from exc
        raise
    sock.listen(1024)
    return sock
