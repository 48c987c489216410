"""asyncrpc-launch across two hosts, built on this machine from network namespaces.

Each host is a network namespace with its own loopback and one end of a veth
pair; the launcher runs once per host, as it would over SSH on real machines::

    netns host0: 10.23.0.1/24  <--- veth --->  netns host1: 10.23.0.2/24
      asyncrpc-launch --node-rank 0              asyncrpc-launch --node-rank 1
        worker0, worker1 (store on 10.23.0.1)      worker2, worker3

Needs root (or CAP_NET_ADMIN) and `ip`; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from conftest import PROGRAMS, start_program
from processes import stacks

pytestmark = [pytest.mark.subprocess, pytest.mark.xdist_group("hosts")]  # one pair of hosts

ADDRESSES = ("10.23.0.1", "10.23.0.2")
PORT = 29500


@dataclass(frozen=True)
class Host:
    namespace: str
    link: str
    address: str

    def rx_bytes(self) -> int:
        path = f"/sys/class/net/{self.link}/statistics/rx_bytes"
        return int(_ip("netns", "exec", self.namespace, "cat", path).stdout)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True, timeout=30)


def _build(tag: str) -> tuple[Host, Host]:
    hosts = tuple(Host(f"arpc{tag}h{i}", f"arpc{tag}v{i}", a) for i, a in enumerate(ADDRESSES))
    for host in hosts:
        _ip("netns", "add", host.namespace)
    _ip("link", "add", hosts[0].link, "type", "veth", "peer", "name", hosts[1].link)
    for host in hosts:
        _ip("link", "set", host.link, "netns", host.namespace)
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.link)
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("-n", host.namespace, "link", "set", host.link, "up")
    return hosts[0], hosts[1]


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root: run the suite as root to test two hosts")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    tag = str(os.getpid() % 100000)
    try:
        built = _build(tag)
    except subprocess.CalledProcessError as exc:
        _remove(tag)
        pytest.skip(f"could not create network namespaces: {exc.stderr.strip()}")
    yield built
    _remove(tag)


def _remove(tag: str) -> None:
    # Deleting a namespace deletes the veth end inside it, and so the pair.
    for i in range(2):
        subprocess.run(["ip", "netns", "del", f"arpc{tag}h{i}"], capture_output=True, timeout=30)


def launch_on_both(
    hosts: tuple[Host, Host],
    script: str,
    *args: str,
    interface: bool = False,
    timeout: float = 90,
    launcher_args: tuple[str, ...] = (),
) -> list[tuple[int, str, str]]:
    """Run `script` on both hosts under asyncrpc-launch; (exit code, stdout, stderr) per host.

    Host 0 finds its interface from the route to the rendezvous host; with
    `interface`, host 1 names its own with --interface.
    """
    procs = []
    for rank, host in enumerate(hosts):
        named = ["--interface", host.link] if interface and rank == 1 else []
        launcher = [sys.executable, "-m", "asyncrpc._launch._cli", "--nnodes", "2"]
        launcher += ["--node-rank", str(rank), "--rdzv-endpoint", f"{ADDRESSES[0]}:{PORT}"]
        launcher += ["--nproc-per-node", "2", *launcher_args, *named, script, *args]
        procs.append(start_program("ip", "netns", "exec", host.namespace, *launcher, env={}))
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, err = proc.communicate()
            pytest.fail(f"a launcher did not finish within {timeout} s:\n{err[-3000:]}")
        results.append((proc.returncode, out, err))
    return results


def _result(results: list[tuple[int, str, str]]) -> dict[str, object]:
    for code, _, err in results:
        assert code == 0, err[-3000:]
    lines = [line for line in results[0][1].splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, results[0][1]
    found: dict[str, object] = json.loads(lines[0].removeprefix("RESULT "))
    return found


def _all_running(procs: list[subprocess.Popen[str]]) -> bool:
    return all(proc.poll() is None for proc in procs)


def test_calls_chains_and_rrefs_cross_the_hosts(hosts: tuple[Host, Host]) -> None:
    before = [host.rx_bytes() for host in hosts]
    result = _result(launch_on_both(hosts, str(PROGRAMS / "two_hosts.py"), interface=True))
    a, b = ADDRESSES
    # Names are stable across hosts: node 0 holds ranks 0-1, node 1 ranks 2-3.
    assert result["hosts"] == {
        "worker0": ["worker0", a],
        "worker1": ["worker1", a],
        "worker2": ["worker2", b],
        "worker3": ["worker3", b],
    }
    # worker0 -> worker2 -> worker1 -> worker3, every hop awaited without a thread.
    assert result["relay"] == {
        "trail": [["worker2", b], ["worker1", a], ["worker3", b]],
        "total": [3.0, 3.0],
    }
    assert result["chained"] == [3.0, 3.0]  # (1 + 1 on worker1) + 1 on worker2
    # The relay traced: one process per worker, each hop's run inside its call.
    assert result["trace"] == {
        "processes": ["worker0", "worker1", "worker2", "worker3"],
        "pairs": 3,
        "inside": True,
        "flows": 3,
    }
    # Made from host 0, owned on host 1, used from both.
    assert result["rref"] == {
        "owner": "worker3",
        "seen": [["worker0", a], ["worker1", a], ["worker2", b]],
    }
    # Nothing listens on every interface or off the private network.
    listening = result["listeners"]
    assert isinstance(listening, dict)
    for name, addresses in listening.items():
        home = a if name in ("worker0", "worker1") else b
        assert addresses and set(addresses) <= {home, "127.0.0.1"}, (name, addresses)
    # The calls went over the veth pair, in both directions.
    after = [host.rx_bytes() for host in hosts]
    assert all(new - old > 10_000 for new, old in zip(after, before, strict=True)), (before, after)


def _shim(directory: pathlib.Path, name: str, text: str) -> None:
    path = directory / name
    path.write_text(text)
    path.chmod(0o755)


def _recipe_env(directory: pathlib.Path, **extra: str) -> dict[str, str]:
    # The recipes call asyncrpc-launch by name, as on a machine with the venv active.
    path = f"{directory}:{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"
    return {"PATH": path, **extra}


def test_the_ssh_recipe_spreads_the_bilstm_example_over_both_hosts(
    hosts: tuple[Host, Host], tmp_path: pathlib.Path
) -> None:
    # `ssh HOST COMMAND` becomes `ip netns exec NAMESPACE bash -c COMMAND`.
    cases = "".join(f"  {h.address}) ns={h.namespace} ;;\n" for h in hosts)
    shim = f'#!/bin/sh\ncase "$1" in\n{cases}  *) exit 255 ;;\nesac\n'
    _shim(tmp_path, "netns-ssh", shim + 'exec ip netns exec "$ns" bash -c "$2"\n')
    env = _recipe_env(
        tmp_path, HOSTS=" ".join(ADDRESSES), NPROC="2", SSH=str(tmp_path / "netns-ssh")
    )
    example = ["examples/bilstm_ensemble.py", "--workers", "4"]
    proc = start_program("bash", "launch/ssh.sh", *example, env=env)
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, (out + err)[-3000:]
    first = [line for line in out.splitlines() if line.startswith(f"[{ADDRESSES[0]}] ")]
    assert sum(line.endswith("equal to serial: True") for line in first) == 3, out
    assert f"[{ADDRESSES[0]}] 4. members spread over 3 workers" in out, out
    # worker1 is on host 0; worker2 and worker3 on host 1.
    assert "placement={'worker1': 2, 'worker2': 1, 'worker3': 1}" in out, out


def test_the_slurm_batch_file_starts_one_launcher_per_node(
    hosts: tuple[Host, Host], tmp_path: pathlib.Path
) -> None:
    # srun runs its command once per node, with that node's SLURM_NODEID.
    lines = ["#!/bin/bash", 'while [[ "$1" == --* ]]; do shift; done', "pids=()"]
    for i, host in enumerate(hosts):
        lines.append(f'SLURM_NODEID={i} ip netns exec {host.namespace} "$@" & pids+=($!)')
    lines += ["status=0", 'for p in "${pids[@]}"; do wait "$p" || status=1; done', "exit $status"]
    _shim(tmp_path, "srun", "\n".join(lines) + "\n")
    env = _recipe_env(tmp_path, SLURM_NNODES="2", MASTER_ADDR=ADDRESSES[0], NPROC="2")
    proc = start_program("bash", "launch/slurm.sbatch", str(PROGRAMS / "two_hosts.py"), env=env)
    out, err = proc.communicate(timeout=90)
    result = _result([(proc.returncode, out, err)])
    assert result["relay"] == {
        "trail": [["worker2", ADDRESSES[1]], ["worker1", ADDRESSES[0]], ["worker3", ADDRESSES[1]]],
        "total": [3.0, 3.0],
    }


def test_a_failure_on_one_host_ends_the_workers_on_the_other(hosts: tuple[Host, Host]) -> None:
    results = launch_on_both(hosts, str(PROGRAMS / "two_hosts.py"), "--fail", timeout=60)
    assert [code for code, _, _ in results] == [1, 1], [err[-2000:] for _, _, err in results]
    assert "worker0 fails on purpose" in results[0][2]
    report = "worker 'worker0' (rank 0, node "
    assert f"{report}" in results[0][2] and "raised RuntimeError" in results[0][2]
    # Host 1's workers leave with the one report of what happened (the first to
    # leave has its launcher stop the other, which may not have printed it yet).
    leaving = [line for line in results[1][2].splitlines() if "leaves the world" in line]
    assert 1 <= len(leaving) <= 2, results[1][2][-3000:]
    assert all(report in line for line in leaving), leaving


SUPERVISED = str(PROGRAMS / "supervised.py")


@pytest.mark.parametrize(("victim", "home"), [("worker1", 0), ("worker2", 1)])
def test_a_killed_worker_on_either_host_ends_both_launchers_naming_it(
    hosts: tuple[Host, Host], victim: str, home: int
) -> None:
    # No call is pending on the victim: only supervision can notice it is gone.
    started = time.monotonic()
    results = launch_on_both(hosts, SUPERVISED, "--kill", victim, "--world", "4", timeout=60)
    took, ended = time.monotonic() - started, time.time()
    assert [code != 0 for code, _, _ in results] == [True, True], [e[-2000:] for *_, e in results]
    kills = [line for line in results[home][1].splitlines() if line.startswith("KILLED ")]
    assert len(kills) == 1, results[home][1]
    after = ended - float(kills[0].split()[1])
    print(f"kill of {victim} on host {home}: both launchers ended {after:.1f} s later")
    killed = f"worker {victim!r} (rank {victim[-1]}, node "
    assert f"{killed}" in results[home][2] and "was killed by SIGKILL" in results[home][2]
    other = results[1 - home][2]
    leaving = [line for line in other.splitlines() if "leaves the world" in line]
    # The first worker there to notice leaves, and its launcher then stops the
    # other with SIGTERM, which may come before that one has noticed too.
    assert 1 <= len(leaving) <= 2, other[-3000:]
    assert all(killed in line and "SIGKILL" in line for line in leaving), leaving
    assert after < 10, f"the launchers took {after:.1f} s to end after the kill"
    assert took < 45, f"the run took {took:.1f} s"


def test_a_killed_worker_on_host_1_restarts_the_world_and_the_job_completes(
    hosts: tuple[Host, Host],
) -> None:
    results = launch_on_both(
        hosts,
        SUPERVISED,
        "--kill",
        "worker2",
        "--world",
        "4",
        timeout=90,
        launcher_args=("--max-restarts", "1"),
    )
    result = _result(results)
    assert result == {"attempt": 1, "ranks": [0, 1, 2, 3]}


HEAL = str(PROGRAMS / "launch_heal.py")


def test_a_killed_worker_on_host_1_is_healed_in_place_by_its_own_launcher(
    hosts: tuple[Host, Host],
) -> None:
    # worker0 (host 0) has worker2 (host 1) kill itself; host 1's launcher replaces it.
    restart = ("--max-restarts", "1", "--restart", "worker")
    results = launch_on_both(hosts, HEAL, "--victim", "worker2", launcher_args=restart)
    result = _result(results)
    assert result == {
        "replaced": [["worker2", 2, 1]],
        "victim_attempt": 1,
        "victim_pid_changed": True,
        "survivors_same": True,
        "counter": 6,
        "tensor": 6.0,
    }
    healed = "asyncrpc: worker 'worker2' (rank 2, node "
    assert healed in results[1][2] and "replacing it in place (restart 1 of 1)" in results[1][2]
    assert "replacing it in place" not in results[0][2], results[0][2][-3000:]
    assert "WORKER worker2 attempt=1 pid=" in results[1][1], results[1][1]


def test_a_worker_past_max_restarts_on_host_1_ends_both_launchers_naming_it(
    hosts: tuple[Host, Host],
) -> None:
    restart = ("--max-restarts", "1", "--restart", "worker")
    started = time.monotonic()
    results = launch_on_both(
        hosts, HEAL, "--victim", "worker2", "--kills", "2", launcher_args=restart
    )
    took = time.monotonic() - started
    assert [code for code, _, _ in results] == [1, 1], [err[-2000:] for *_, err in results]
    named = "asyncrpc-launch: worker 'worker2' (rank 2, node "
    ended = "the world replaced workers 1 times (--max-restarts 1), so this failure ends it"
    last = results[1][2].splitlines()[-1]
    assert last.startswith(named) and last.endswith(ended), results[1][2][-3000:]
    other = [line for line in results[0][2].splitlines() if line.startswith(named)]
    assert other and other[0].endswith(f"{ended}; this node's workers were stopped"), other
    assert took < 45, f"the run took {took:.1f} s"


NETEM = ("netem", "delay", "50ms", "loss", "5%")
# Where the kernel has no netem (sch_netem): a 8 Mbit/s link with a 16 kB queue,
# which the load overruns, so packets queue (delay) and are tail-dropped (loss).
NARROW = ("tbf", "rate", "8mbit", "burst", "16kb", "limit", "16kb")


def _shape(host: Host, qdisc: tuple[str, ...]) -> bool:
    command = ["ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace", "dev", host.link]
    return (
        subprocess.run([*command, "root", *qdisc], capture_output=True, timeout=30).returncode == 0
    )


def _dropped(host: Host) -> int:
    command = [
        "ip",
        "netns",
        "exec",
        host.namespace,
        "tc",
        "-s",
        "qdisc",
        "show",
        "dev",
        host.link,
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    return sum(int(n) for n in re.findall(r"dropped (\d+)", out))


def test_a_load_run_over_a_delaying_lossy_link_ends_every_call(hosts: tuple[Host, Host]) -> None:
    qdisc = NETEM if all(_shape(host, NETEM) for host in hosts) else NARROW
    if qdisc is NARROW and not all(_shape(host, NARROW) for host in hosts):
        pytest.skip("this kernel has neither netem nor tbf queueing disciplines")
    try:
        args = ("--calls", "300", "--in-flight", "32", "--timeout", "10", "--payload", "8192")
        result = _result(
            launch_on_both(hosts, str(PROGRAMS / "netem_load.py"), *args, timeout=150)
        )
        result["dropped_packets"] = sum(_dropped(host) for host in hosts)
    finally:
        for host in hosts:
            _shape(host, ("pfifo",))
    print(f"faulty link ({' '.join(qdisc)}):", result)  # the README's reliability figures
    assert result["ended"] is True
    assert result["lost"] == 0 and result["wrong"] == 0 and result["executed_twice"] == 0
    failed = result["failed"]
    assert isinstance(failed, dict)
    assert set(failed) <= {"CallTimeoutError", "WorkerUnreachableError"}, failed
    assert result["ok"] + sum(failed.values()) == result["calls"]
    assert result["dropped_packets"] > 0, "the link dropped nothing: the test shaped no fault"


def test_asyncrpc_dump_on_either_host_sees_every_worker(
    hosts: tuple[Host, Host], tmp_path: pathlib.Path
) -> None:
    # Each host has a runtime folder of its own, as separate machines do: host 1's
    # command finds only its own workers' registrations, and asks all four through
    # the world's store on host 0.
    folders = [tmp_path / f"host{i}" for i in range(2)]
    procs = []
    for rank, (host, folder) in enumerate(zip(hosts, folders, strict=True)):
        folder.mkdir()
        launcher = [sys.executable, "-m", "asyncrpc._launch._cli", "--nnodes", "2"]
        launcher += ["--node-rank", str(rank), "--rdzv-endpoint", f"{ADDRESSES[0]}:{PORT}"]
        launcher += ["--nproc-per-node", "2", str(PROGRAMS / "busy_world.py"), "30"]
        procs.append(start_program("ip", "netns", "exec", host.namespace, *launcher,
                                   env={"XDG_RUNTIME_DIR": str(folder)}))  # fmt: skip
    try:
        assert procs[0].stdout is not None
        assert procs[0].stdout.readline().startswith("BUSY"), "worker0 never got busy"
        dump = subprocess.run(
            ["ip", "netns", "exec", hosts[1].namespace, sys.executable, "-m",
             "asyncrpc._inspect._dump", "--json"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "XDG_RUNTIME_DIR": str(folders[1])},
        )  # fmt: skip
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert dump.returncode == 0, dump.stderr[-3000:]
    result = json.loads(dump.stdout)
    assert result["world"] == f"{ADDRESSES[0]}:{PORT}"
    workers = result["workers"]
    assert [w["name"] for w in workers] == ["worker0", "worker1", "worker2", "worker3"]
    assert all(w["pid"] for w in workers)
    crunch = workers[1]["threads"][0]
    assert crunch["call"] == "crunch()" and crunch["caller"] == "worker0"


@pytest.mark.timeout(330)  # the start's 150 s bound, then each launcher's end
def test_a_node_joins_a_running_world_and_a_preempted_one_leaves_while_the_run_goes_on(
    hosts: tuple[Host, Host], tmp_path: pathlib.Path
) -> None:
    # Nodes 0 and 1 (one per host) form an elastic world of 4; a third launcher on
    # host 1 joins it with --join and 2 workers; worker0 has node 1 start one more.
    # SIGTERM to node 1's launcher (a spot preemption notice): its 3 workers leave,
    # node 0 and the joined node go on, and every launcher ends 0.
    status = tmp_path / "status"
    script = [str(PROGRAMS / "elastic_launch.py"), "nodes", str(status)]
    launcher = [sys.executable, "-m", "asyncrpc._launch._cli", "--elastic", "--nproc-per-node"]
    procs = []
    for rank, host in enumerate(hosts):
        argv = [*launcher, "2", "--nnodes", "2", "--node-rank", str(rank)]
        argv += ["--rdzv-endpoint", f"{ADDRESSES[0]}:{PORT}", *script]
        procs.append(start_program("ip", "netns", "exec", host.namespace, *argv, env={}))
    joined = [*launcher, "2", "--join", f"{ADDRESSES[0]}:{PORT}", *script]
    try:
        # 17-35 s here; past 60 s under a load of 9-11 on 2 cores (three launchers and
        # their warm interpreters each import torch, one after another): bounded, not timed.
        deadline = time.monotonic() + 150
        time.sleep(2)  # node 0's store listens by then; a join before it is refused
        procs.append(start_program("ip", "netns", "exec", hosts[1].namespace, *joined, env={}))
        while not status.exists() and _all_running(procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not status.exists():  # each launcher's threads, and its tree ended
            said = [f"--- launcher {n}:\n{stacks(proc)}" for n, proc in enumerate(procs)]
            raise AssertionError("worker0 never saw the joined node\n" + "\n".join(said))
        procs[1].send_signal(signal.SIGTERM)  # `ip netns exec` passes it to the launcher
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    result = _result(results)  # every launcher ended 0
    who = result["who"]
    assert isinstance(who, dict)
    nodes = {name: w[3] for name, w in who.items()}
    assert nodes == {"worker0": "0", "worker1": "0", "worker2": "1", "worker3": "1",
                     "worker4": "2", "worker5": "2", "worker6": "1"}  # fmt: skip
    assert result["on_node_1"] == ["worker2", "worker3", "worker6"]
    left = result["left"]
    assert isinstance(left, list) and [name for name, _ in left] == result["on_node_1"]
    assert all("node 1" in why and "preempted by SIGTERM" in why for _, why in left), left
    after = result["after"]
    assert isinstance(after, list) and after[0] == "WorkerLeftError"
    assert result["rest"] == {"worker1": "worker1", "worker4": "worker4", "worker5": "worker5"}
    assert result["members"] == ["worker0", "worker1", "worker4", "worker5"]
    assert "its workers ['worker2', 'worker3', 'worker6'] left the world" in results[1][2]
