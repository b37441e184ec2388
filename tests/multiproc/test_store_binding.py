"""The trainer group's key-value stores listen on the address the group uses only (issue 22, item 7).

torch's TCPStore server listens on every interface with no auth, and the stores carry pickles. A
one-node group's stores must listen on 127.0.0.1 alone: under rlmega's torchrun (both of the agent's
stores) and for a group rlmega starts itself (rank 0's store, rlmega.process.distributed.init_distributed). Sockets are
read with psutil, i.e. from /proc/net/tcp{,6}.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rlmega.process.bound_store import BoundTCPStore
from rlmega.testing.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]

# A torchrun job's rank 0 reports where its agent (its parent, torchrun) listens.
AGENT_PROBE = """
import json, os, psutil, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    agent = psutil.Process().parent()
    print(json.dumps({"master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])],
                      "listening": [[c.laddr.ip, c.laddr.port] for c in agent.net_connections(kind="inet")
                                    if c.status == psutil.CONN_LISTEN]}), flush=True)
dist.barrier()
"""


def _listening(pid: int) -> list[list]:
    return [
        [c.laddr.ip, c.laddr.port]
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_rlmega_torchrun_on_one_node_listens_on_loopback_only(tmp_path):
    (tmp_path / "probe.py").write_text(AGENT_PROBE)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlmega.launch.torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(tmp_path / "probe.py"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["master"][0] == "127.0.0.1"
    # rendezvous + shared store
    assert [a for a, _ in seen["listening"]] == ["127.0.0.1", "127.0.0.1"], seen
    assert seen["master"][1] in [p for _, p in seen["listening"]]


def _rank0_store():
    import errno
    import socket

    from rlmega.process.distributed import init_distributed

    port = int(os.environ["MASTER_PORT"])
    held = None
    if os.environ["RANK"] == "0":  # before its store: is the port already this rank's, or anyone's?
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            try:
                other.bind(("127.0.0.1", port))
                held = False
            except OSError as e:
                held = e.errno == errno.EADDRINUSE
    init_distributed()
    import torch.distributed as dist

    found = [ip for ip, p in _listening(os.getpid()) if p == port] if dist.get_rank() == 0 else None
    dist.barrier()
    return found, held


def test_a_group_rlmega_starts_listens_on_master_addr_only():
    # run_on_ranks gives MASTER_ADDR=127.0.0.1, as the Ray launcher does for ranks on one node. Its rank 0
    # holds the port from the parent's choice on (CI of 2026-12-07 lost a run to EADDRINUSE when it did not).
    found, held = run_on_ranks(_rank0_store, 2, timeout_s=120)[0]
    assert found == ["127.0.0.1"] and held


def test_a_group_that_spans_nodes_refuses_a_store_on_loopback():
    BoundTCPStore.refuse_loopback = True
    try:
        with pytest.raises(
            RuntimeError,
            match="resolves to loopback on this node.*Fix: pass this node's network address",
        ):
            BoundTCPStore("localhost", 0, is_master=True)
    finally:
        BoundTCPStore.refuse_loopback = False


def test_a_store_for_several_nodes_listens_on_the_nodes_address_only():
    import socket

    ips = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not ips:
        pytest.skip("this machine has no IPv4 address besides loopback")
    # as rlmega.launch.torchrun sets it for a run that spans nodes
    BoundTCPStore.refuse_loopback = True
    try:
        store = BoundTCPStore(ips[0], 0, is_master=True, wait_for_workers=False)
        assert [ip for ip, p in _listening(os.getpid()) if p == store.port] == [ips[0]]
    finally:
        BoundTCPStore.refuse_loopback = False


def test_a_reserved_port_is_nobody_elses_until_the_store_serves_it():
    """Rank 0's port is found by its Ray actor seconds before the store binds it; let go meanwhile, another
    process took it (EADDRINUSE, CI of 2026-12-04 with two runs at once). reserve_port holds it until then."""
    import errno
    import socket

    from rlmega.process.bound_store import reserve_port

    port = reserve_port()
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError) as e:
        # what another process's bind(0) or store would do meanwhile
        other.bind(("127.0.0.1", port))
    assert e.value.errno == errno.EADDRINUSE
    other.close()
    # ours: it binds
    store = BoundTCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    store.set("k", "v")
    assert store.get("k") == b"v" and ["127.0.0.1", port] in _listening(os.getpid())
