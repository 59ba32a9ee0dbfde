"""Joining an existing Ray cluster: the address check (pure) and the failures that must
come quickly and name the address (no cluster is started here; the two-node join runs in
the driver's ``test_driver_cluster_two_nodes.py``)."""

from __future__ import annotations

import socket
import time

import pytest
import ray
from ppo_placement import RayJoinError, join_ray, parse_cluster_address


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("auto", None),
        (" auto ", None),
        ("127.0.0.1:6379", ("127.0.0.1", 6379)),
        ("head-node.example.org:1", ("head-node.example.org", 1)),
        ("localhost:65535", ("localhost", 65535)),
        ("[::1]:6379", ("::1", 6379)),
    ],
)
def test_good_addresses_parse(address: str, expected: tuple[str, int] | None) -> None:
    assert parse_cluster_address(address) == expected


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("127.0.0.1", "has no port"),
        (":6379", "has no port"),
        ("127.0.0.1:", "port '' is not a number"),
        ("127.0.0.1:port", "port 'port' is not a number"),
        ("127.0.0.1:0", "port '0' is not a number in 1..65535"),
        ("127.0.0.1:70000", "port '70000' is not a number in 1..65535"),
        ("ray://head:10001", "is a ray:// URL"),
        ("http://head:6379", "is a http:// URL"),
        ("::1:6379", "is not a host name"),
        ("[not-v6]:6379", "is not an IPv6 address"),
        ("bad host:6379", "is not a host name"),
        ("-x:6379", "is not a host name"),
    ],
)
def test_bad_addresses_are_refused_with_the_fix(address: str, why: str) -> None:
    with pytest.raises(ValueError, match="host:port") as info:
        parse_cluster_address(address)
    assert why in str(info.value)
    assert "auto" in str(info.value)  # the fix names both forms


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the socket closes


def test_unreachable_address_fails_fast_and_names_it() -> None:
    if ray.is_initialized():  # pragma: no cover - another test left Ray up
        ray.shutdown()
    port = _closed_port()
    t0 = time.perf_counter()
    with pytest.raises(RayJoinError) as info:
        join_ray(f"127.0.0.1:{port}", connect_timeout_s=5.0)
    assert time.perf_counter() - t0 < 30
    text = str(info.value)
    assert f"127.0.0.1:{port}" in text and "cannot reach" in text
    assert "ray start --head" in text  # what to do
    assert not ray.is_initialized()


def test_malformed_address_raises_before_any_connection() -> None:
    with pytest.raises(ValueError, match="has no port"):
        join_ray("127.0.0.1")
    assert not ray.is_initialized()
