"""Exposure: while a single-node world runs, its processes listen on loopback only."""

from __future__ import annotations

import ipaddress
import os
import pathlib
import socket
import struct
import sys
import time

import pytest

from asyncrpc._core import _net

from conftest import PROGRAMS, bin_path, start_program
from test_supervisor import _wait_for_pids


def _tree(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid]
        found.update(children)
        frontier.extend(children)
    return found


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        fd_dir = pathlib.Path(f"/proc/{pid}/fd")
        try:
            links = [os.readlink(fd) for fd in fd_dir.iterdir()]
        except OSError:
            continue
        inodes.update(link[8:-1] for link in links if link.startswith("socket:["))
    return inodes


def _decode(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(struct.pack("<I", int(hex_addr, 16))))
    words = struct.unpack("<4I", raw)
    return str(ipaddress.IPv6Address(struct.pack(">4I", *words)))


def listening_addresses(root: int) -> list[str]:
    """Local addresses of every TCP socket in LISTEN state owned by `root`'s process tree."""
    inodes = _socket_inodes(_tree(root))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(_decode(fields[1].split(":")[0]))
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "launcher",
    [[sys.executable], [bin_path("asyncrpc-launch"), "--nproc-per-node", "3"]],
    ids=["embedded", "asyncrpc-launch"],
)
def test_single_node_world_listens_on_loopback_only(
    launcher: list[str], tmp_path: pathlib.Path
) -> None:
    pids_dir, release = tmp_path / "pids", tmp_path / "release"
    pids_dir.mkdir()
    env = {"PIDS_DIR": str(pids_dir), "RELEASE": str(release)}
    proc = start_program(*launcher, str(PROGRAMS / "idle.py"), env=env)
    try:
        _wait_for_pids(pids_dir, 3)
        time.sleep(0.5)
        addresses = listening_addresses(proc.pid)
        release.touch()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert len(addresses) >= 4  # the store and three RPC agents at least
    exposed = [a for a in addresses if not ipaddress.ip_address(a).is_loopback]
    assert exposed == []


def test_loopback_detection() -> None:
    assert _net.is_loopback("127.0.0.1")
    assert _net.is_loopback("localhost")
    assert not _net.is_loopback("10.23.0.1")
    assert _net.interface_for("127.0.0.1") == "lo"


def test_listen_on_a_taken_port_raises_port_in_use() -> None:
    import asyncrpc

    taken = _net.listen_on("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(asyncrpc.PortInUseError, match=f"port {port} .* already in use"):
            _net.listen_on("127.0.0.1", port)
    finally:
        taken.close()
    with socket.socket() as probe:  # the failed attempt left nothing bound
        probe.bind(("127.0.0.1", port))
