"""The NIC choice that multi-node launches pass on (launch/distributed.py) and the pure parts of
the network-namespace test cluster (tests/cluster/netns_cluster.py); no root needed."""

from __future__ import annotations

import pytest

from launch.distributed import LaunchError, chosen_interface, interface_address
from tests.cluster.netns_cluster import Cluster, ClusterError


@pytest.mark.parametrize(
    "env, ifname",
    [
        ({}, None),
        ({"GLOO_SOCKET_IFNAME": "eth1"}, "eth1"),
        ({"NCCL_SOCKET_IFNAME": "ib0,eth1"}, "ib0"),
        ({"NCCL_SOCKET_IFNAME": "=eth2"}, "eth2"),
        ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, None),  # an exclusion list names no interface
        ({"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib0"}, "eth1"),
    ],
)
def test_chosen_interface(env, ifname):
    assert chosen_interface(env) == ifname


def test_interface_address():
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(LaunchError, match="'no-such-nic0'.*no IPv4 address"):
        interface_address("no-such-nic0")


def test_cluster_names_and_commands():
    c = Cluster(hosts=3, name="bx", subnet="10.231.5")
    assert c.hostnames == ["bx-node0", "bx-node1", "bx-node2"]
    assert [c.address(i) for i in range(3)] == ["10.231.5.1", "10.231.5.2", "10.231.5.3"]
    argv = c.command("bx-node2", ["hostname"])
    assert argv[:2] == ["nsenter", "--net=/run/netns/bx-node2"] and argv[-3:] == [
        "bx-node2",
        "/etc/netns/bx-node2",
        "hostname",
    ]
    assert c.command(1, ["x"])[1] == "--net=/run/netns/bx-node1"


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"hosts": 0}, "hosts=0"),
        ({"name": "a-b"}, "name 'a-b'"),
        ({"name": "toolongname"}, "up to 8"),
        ({"subnet": "10.231"}, "three octets"),
        ({"subnet": "10.300.0"}, "three octets"),
    ],
)
def test_cluster_rejects_bad_settings(kw, message):
    with pytest.raises(ClusterError, match=message):
        Cluster(**kw)


def test_unknown_host_is_named():
    c = Cluster(hosts=2, name="bx")
    with pytest.raises(ClusterError, match="'bx-node7': not one of bx-node0, bx-node1"):
        c.command("bx-node7", ["true"])
    with pytest.raises(ClusterError, match="host 2: the cluster has hosts 0..1"):
        c.index(2)
