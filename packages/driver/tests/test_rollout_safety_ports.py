"""Everything the project starts listens on loopback only: the weight-refit store and its
gloo transport, and a two-rank trainer process group from a ``tcp://127.0.0.1:P``
rendezvous (torch's own store server would listen on every interface, ``[::]``).

The scan reads Linux's ``/proc``: ``/proc/net/tcp{,6}`` for sockets in LISTEN state and
``/proc/<pid>/fd`` to tell which process owns them. ``test_engine_ray.py`` runs the same
scan over a real Ray cluster after a refit.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from driver_testlib import gloo_refit_pair
from ppo_driver.workers import free_port

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads listening sockets from /proc"
)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (Ray's GCS, raylet and workers descend from the
    process that started the cluster)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # each 32-bit word is stored in host byte order (little-endian on x86 and arm64)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def listening_sockets(pids: Iterable[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket in LISTEN state owned by ``pids``."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # the process ended meanwhile
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[len("socket:[") : -1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _LISTEN and inode in owner:
                    host, port = local.split(":")
                    found.append((owner[inode], _address(host), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1
    return ip.is_loopback


def test_scan_sees_a_listener_on_every_interface() -> None:
    """The scan itself: it finds this process's listeners and flags a wildcard bind."""
    import socket

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.bind(("::", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        found = listening_sockets(process_tree(os.getpid()))
    assert (os.getpid(), "::", port) in found
    assert not is_loopback("::") and not is_loopback("0.0.0.0")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")


def test_refit_store_and_gloo_transport_listen_on_loopback_only() -> None:
    with gloo_refit_pair() as send:
        version, tensors, _ = send({"w": torch.arange(6.0)}, 7)
        assert version == 7 and tensors["w"].tolist() == list(range(6))
        found = listening_sockets([os.getpid()])
        assert send.port in {p for _, _, p in found}  # the scan sees the store
        assert [s for s in found if not is_loopback(s[1])] == []


def _rank_main(rank: int, backend: str, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    if backend == "megatron":
        from ppo_trainer.megatron._backend import _init_distributed as init_group
    else:
        from ppo_trainer._torch_backend import init_process_group as init_group
    init_group(rank=rank, world_size=2, dist_init_method=init, device=torch.device("cpu"))
    total = torch.ones(1)
    dist.all_reduce(total)  # the gloo pair is connected and used
    dist.barrier()
    report = {
        "sum": float(total.item()),
        "listeners": listening_sockets([os.getpid()]),
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # nobody leaves before both scanned
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_trainer_tcp_rendezvous_listens_on_loopback_only(backend: str, tmp_path: Path) -> None:
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    init = f"tcp://127.0.0.1:{free_port()}"  # what TrainGroup hands its ranks
    mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _rank_main,
        args=(backend, init, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in reports] == [2.0, 2.0]
    port = int(init.rsplit(":", 1)[1])
    assert port in {p for _, _, p in reports[0]["listeners"]}  # rank 0 hosts the store
    assert all(r["gloo_ifname"] == "lo" for r in reports)
    for rank, report in enumerate(reports):
        wide = [tuple(s) for s in report["listeners"] if not is_loopback(s[1])]
        assert wide == [], f"rank {rank} listens beyond loopback: {wide}"
