"""A cluster of H hosts on one Linux machine, made of network namespaces: for testing the
multi-node launch paths (torchrun, mpirun, Slurm) and lost or slow nodes without a cluster.

Host i is a network namespace ``<name>-node<i>`` with one interface ``cl0`` at
``<subnet>.<i+1>/24``, loopback up, and its own hostname (each command runs in a fresh UTS
namespace whose hostname is the host's name, so Open MPI and Slurm see different nodes,
and a mount namespace of its own).
The hosts' ``cl0`` links are veth pairs onto a bridge that lives in a namespace of its own
(``<name>-hub``): nothing is added to the machine's own network namespace, and packets
can only travel between the hosts. Each host's ``/etc/hosts`` (``/etc/netns/<ns>/hosts``
mounted over it) names every host of the cluster, as on a real one; its resolv.conf is
empty, so no name is ever looked up outside.

    python -m tests.cluster.netns_cluster up --hosts 2          # prints the hosts and addresses
    python -m tests.cluster.netns_cluster exec bcl-node1 -- hostname -I
    python -m tests.cluster.netns_cluster shape --delay-ms 20 --rate-mbit 100   # a slow network, until Ctrl-C
    python -m tests.cluster.netns_cluster down

``up`` also writes an ssh stand-in (``<state dir>/rsh``: ``rsh HOST COMMAND...`` runs
COMMAND with a shell on HOST) for Open MPI's ``plm_ssh_agent``. ``down`` kills every
process inside the hosts' namespaces and deletes the namespaces, the links and the state
directory; ``up`` first does the same to anything left over under the same name.
Needs root, iproute2 (``ip``) and util-linux (``unshare``, ``nsenter``); ``shape`` needs ethtool.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from common.files import publishing

IFNAME = "cl0"  # each host's cluster interface
STATE_ROOT = "/run/netns-cluster"
NETNS_ETC = "/etc/netns"
NETNS_RUN = "/run/netns"  # where `ip netns add` mounts the namespaces


class ClusterError(RuntimeError):
    """A step of building or using the cluster failed; the message names the command."""


def missing_requirements() -> str | None:
    """Why a cluster cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install iproute2 util-linux)"
    probe = f"nscprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_namespace_processes(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process whose network namespace is ``netns`` (repeat while they fork)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["ip", "netns", "pids", netns], check=False, capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise ClusterError(f"processes {pids} in namespace {netns} survive SIGKILL")
        time.sleep(0.05)


@dataclass
class Cluster:
    """H hosts as network namespaces; see the module docstring. ``name`` prefixes everything."""

    hosts: int = 2
    name: str = "bcl"
    subnet: str = "10.231.0"  # the first three octets: host i is <subnet>.<i+1>
    state_dir: str = field(init=False)

    def __post_init__(self):
        if not 1 <= self.hosts <= 200:
            raise ClusterError(f"hosts={self.hosts}: choose 1..200")
        if not self.name.replace("_", "").isalnum() or len(self.name) > 8:
            raise ClusterError(f"name {self.name!r}: up to 8 letters, digits or _")
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets):
            raise ClusterError(f"subnet {self.subnet!r}: give three octets, e.g. 10.231.0")
        self.state_dir = os.path.join(STATE_ROOT, self.name)
        self._relay: subprocess.Popen | None = None  # the delaying hub process (shape)

    # -- names ---------------------------------------------------------------------------
    def hostname(self, i: int) -> str:
        return f"{self.name}-node{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def hub(self) -> str:
        return f"{self.name}-hub"

    @property
    def hostnames(self) -> list[str]:
        return [self.hostname(i) for i in range(self.hosts)]

    @property
    def rsh_agent(self) -> str:
        return os.path.join(self.state_dir, "rsh")

    def index(self, host: int | str) -> int:
        if isinstance(host, int):
            if not 0 <= host < self.hosts:
                raise ClusterError(f"host {host}: the cluster has hosts 0..{self.hosts - 1}")
            return host
        if host not in self.hostnames:
            raise ClusterError(f"host {host!r}: not one of {', '.join(self.hostnames)}")
        return self.hostnames.index(host)

    # -- life cycle ----------------------------------------------------------------------
    def up(self) -> Cluster:
        """Build the cluster (after removing leftovers of one with the same name)."""
        self.down()
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            hosts_file = "127.0.0.1 localhost\n" + "".join(
                f"{self.address(i)} {self.hostname(i)}\n" for i in range(self.hosts)
            )
            for i in range(self.hosts):
                ns = self.hostname(i)
                os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
                with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                    f.write(hosts_file)
                # No name server: a name not in /etc/hosts fails at once, nothing is asked outside.
                open(os.path.join(NETNS_ETC, ns, "resolv.conf"), "w").close()
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.hub, "link", "add", f"h{i}", "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
            os.makedirs(self.state_dir, exist_ok=True)
            self._write_rsh_agent()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill every process in the hosts, delete namespaces, links and state (idempotent)."""
        prefix = f"{self.name}-"
        for ns in _namespaces():
            if ns.startswith(prefix):
                kill_namespace_processes(ns)
                subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
                shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        if os.path.isdir(NETNS_ETC):
            for ns in os.listdir(NETNS_ETC):
                if ns.startswith(prefix):
                    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def _write_rsh_agent(self) -> None:
        # ssh's contract: `rsh HOST ARGS...` runs the words ARGS joined by spaces with a shell
        # on HOST. Here HOST's namespace and hostname stand for the remote machine.
        lines = [
            "#!/bin/sh",
            f"# ssh stand-in for the netns cluster {self.name!r} (tests/cluster/netns_cluster.py)",
            "host=$1; shift",
            "case $host in",
        ]
        for i in range(self.hosts):
            prefix = " ".join(shlex.quote(a) for a in self.command(i, ["sh", "-c"]))
            lines.append(f'    {self.hostname(i)}|{self.address(i)}) exec {prefix} "$*" ;;')
        lines += ['    *) echo "rsh: unknown host $host" >&2; exit 255 ;;', "esac", ""]
        with publishing(self.rsh_agent) as tmp:
            tmp.write_text("\n".join(lines))
            os.chmod(tmp, 0o755)

    # -- running things on hosts -------------------------------------------------------
    def command(self, host: int | str, argv: list[str]) -> list[str]:
        """The argv that runs ``argv`` on ``host`` (its namespace, its hostname)."""
        name = self.hostname(self.index(host))
        etc = os.path.join(NETNS_ETC, name)
        # Not `ip netns exec`: it remounts /sys, hiding the cgroup mounts slurmd needs. The
        # private mount namespace gives the host its own /etc/hosts and resolv.conf.
        script = (
            'mount --bind "$1/hosts" /etc/hosts && mount --bind "$1/resolv.conf" /etc/resolv.conf && '
            'echo "$0" > /proc/sys/kernel/hostname && shift && exec "$@"'
        )
        return [
            "nsenter",
            f"--net={NETNS_RUN}/{name}",
            "unshare",
            "--uts",
            "--mount",
            "--",
            "sh",
            "-c",
            script,
            name,
            etc,
            *argv,
        ]

    def kill_host(self, host: int | str) -> None:
        """Every process on ``host`` dies at once, as when the machine loses power."""
        kill_namespace_processes(self.hostname(self.index(host)))

    def set_link(self, host: int | str, up: bool) -> None:
        """Plug ``host``'s cable in or out (its interface keeps its address)."""
        _ip("-n", self.hub, "link", "set", f"h{self.index(host)}", "up" if up else "down")

    def shape(self, delay_ms: float, rate_mbit: float | None = None) -> None:
        """Delay every frame between hosts by ``delay_ms`` (one way) and limit each host's
        link to ``rate_mbit``, as ``tc netem delay ... rate ...`` on every host would.

        The hub forwards frames itself (``relay``, in a process in the hub's namespace)
        instead of the bridge: kernels without sch_netem (VMs, containers) get the same
        delay. Offloads are switched off on the hosts' interfaces so that every frame the
        relay reads fits the wire as it is. ``unshape`` puts the bridge back.
        """
        self.unshape()
        for i in range(self.hosts):
            done = subprocess.run(
                self.command(i, ["ethtool", "-K", IFNAME, "tso", "off", "gso", "off", "gro", "off", "tx", "off"]),
                check=False,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise ClusterError(
                    f"ethtool -K {IFNAME} on {self.hostname(i)} (apt-get install ethtool): {done.stderr.strip()}"
                )
            done = subprocess.run(
                ["ip", "netns", "exec", self.hub, "ethtool", "-K", f"h{i}", "gro", "off"],
                check=False,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise ClusterError(f"ethtool -K h{i} gro off in {self.hub}: {done.stderr.strip()}")
            _ip("-n", self.hub, "link", "set", f"h{i}", "nomaster")
        argv = [
            sys.executable,
            "-m",
            "tests.cluster.netns_cluster",
            "--name",
            self.name,
            "relay",
            "--delay-ms",
            f"{delay_ms:g}",
            *(["--rate-mbit", f"{rate_mbit:g}"] if rate_mbit else []),
            *(f"h{i}" for i in range(self.hosts)),
        ]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self._relay = subprocess.Popen(
            ["ip", "netns", "exec", self.hub, *argv],
            cwd=root,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = os.path.join(self.state_dir, "relay.ready")
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if self._relay.poll() is not None or time.monotonic() > deadline:
                why = self._relay.stderr.read() if self._relay.poll() is not None else "no sign of life in 30 s"
                self.unshape()
                raise ClusterError(f"the delaying hub did not start: {why}")
            time.sleep(0.05)

    def unshape(self) -> None:
        """Back to the plain bridge (no delay)."""
        kill_namespace_processes(self.hub)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.state_dir, "relay.ready"))
        for i in range(self.hosts):
            _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0")

    def describe(self) -> str:
        return (
            "\n".join(f"{self.hostname(i)}  {self.address(i)}  ({IFNAME})" for i in range(self.hosts))
            + f"\nssh stand-in (Open MPI plm_ssh_agent): {self.rsh_agent}"
        )


def relay(ports: list[str], delay_ms: float, rate_mbit: float | None, ready_file: str) -> None:
    """Forward Ethernet frames between ``ports`` (a learning switch), each one ``delay_ms``
    late and, with ``rate_mbit``, no faster than that rate per destination port. Runs until
    killed; writes ``ready_file`` once its sockets are open."""
    socks, socks_by_port = {}, {}
    for port in ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
        s.bind((port, 0))
        s.setblocking(False)
        socks[s.fileno()] = (port, s)
        socks_by_port[port] = s
    where: dict[bytes, str] = {}  # source MAC -> port it was seen on
    link_free = dict.fromkeys(ports, 0.0)  # when each port's wire is free again
    queue: list[tuple[float, int, str, bytes]] = []
    seq = 0
    delay = delay_ms / 1e3
    with open(ready_file, "w"):
        pass
    poller = select.poll()
    for fd in socks:
        poller.register(fd, select.POLLIN)
    # (the heap orders frames by departure; seq keeps equal times in arrival order)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, port, frame = heapq.heappop(queue)
            with contextlib.suppress(OSError):
                socks_by_port[port].send(frame)
        timeout = max(0.0, queue[0][0] - time.monotonic()) * 1e3 if queue else 1000
        for fd, _ in poller.poll(timeout):
            port, s = socks[fd]
            while True:
                try:
                    frame, addr = s.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] == socket.PACKET_OUTGOING:  # what this relay itself sent
                    continue
                where[frame[6:12]] = port
                dest = where.get(frame[0:6])
                arrived = time.monotonic()
                for out in [dest] if dest and dest != port else [p for p in ports if p != port]:
                    depart = arrived + delay
                    if rate_mbit:
                        link_free[out] = max(link_free[out], arrived) + len(frame) * 8 / (rate_mbit * 1e6)
                        depart = max(depart, link_free[out] + delay)
                    seq += 1
                    heapq.heappush(queue, (depart, seq, out, frame))


def _existing_hosts(name: str) -> int:
    return sum(1 for ns in _namespaces() if ns.startswith(f"{name}-node"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.netns_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="bcl", help="prefix of every namespace (default bcl)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build the cluster (removing leftovers of the same name)")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--subnet", default="10.231.0", help="first three octets (default 10.231.0)")
    sub.add_parser("down", help="kill its processes, delete namespaces, links and state")
    sh = sub.add_parser("shape", help="delay (and rate-limit) the network until Ctrl-C")
    sh.add_argument("--delay-ms", type=float, required=True)
    sh.add_argument("--rate-mbit", type=float)
    rl = sub.add_parser("relay", help=argparse.SUPPRESS)  # the hub's forwarding process (shape)
    rl.add_argument("--delay-ms", type=float, required=True)
    rl.add_argument("--rate-mbit", type=float)
    rl.add_argument("ports", nargs="+")
    ex = sub.add_parser("exec", help="run a command on a host: exec HOST -- CMD ...")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    try:
        if args.cmd == "up":
            reason = missing_requirements()
            if reason:
                print(f"netns_cluster: {reason}", file=sys.stderr)
                return 1
            print(Cluster(args.hosts, args.name, args.subnet).up().describe())
        elif args.cmd == "down":
            Cluster(1, args.name).down()
        elif args.cmd == "relay":
            relay(args.ports, args.delay_ms, args.rate_mbit, os.path.join(STATE_ROOT, args.name, "relay.ready"))
        elif args.cmd == "shape":
            cluster = Cluster(max(1, _existing_hosts(args.name)), args.name)
            cluster.shape(args.delay_ms, args.rate_mbit)
            print(
                f"{cluster.hosts} hosts: {args.delay_ms:g} ms each way"
                + (f", {args.rate_mbit:g} Mbit/s" if args.rate_mbit else "")
                + "; Ctrl-C ends it"
            )
            try:
                cluster._relay.wait()
            except KeyboardInterrupt:
                pass
            finally:
                cluster.unshape()
        else:
            command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not command:
                print("netns_cluster: exec needs a command after the host", file=sys.stderr)
                return 2
            cluster = Cluster(max(1, _existing_hosts(args.name)), args.name)
            return subprocess.call(cluster.command(args.host, command))
    except ClusterError as e:
        print(f"netns_cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
