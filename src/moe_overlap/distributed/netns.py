"""`--link netns:RATE`: each rank in its own network namespace, joined by a shaped bridge.

Namespace names carry the creating process's pid and start time, so a namespace whose creator
is gone (killed, crashed) is recognised as stale even if the pid was reused;
``cleanup_stale`` (and ``moe-overlap cleanup``) removes them. A live link is removed when it is
closed, and at interpreter exit; turning SIGTERM into an exit is the entry point's job (the CLI
does it), never the library's.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import subprocess
import weakref

from moe_overlap.distributed.link import parse_rate

NETNS_DIR = "/var/run/netns"  # where `ip netns add` bind-mounts the namespaces it names
CLONE_NEWNET = 0x40000000
FALLBACK_HINT = "use --link model:BANDWIDTH,LATENCY (e.g. model:2gbit,50us) instead"
DEFAULT_PREFIX = "moeo"


class LinkUnavailable(RuntimeError):
    """Namespaces or tc shaping cannot be set up here."""


def _run(command: str, check: bool = True) -> None:
    """Run an iproute2 command line (our names never contain spaces)."""
    result = subprocess.run(command.split(), capture_output=True, text=True)
    if check and result.returncode != 0:
        hint = "tc tbf qdisc unavailable; " if command.startswith("tc") else ""
        error = result.stderr.strip()
        raise LinkUnavailable(f"`{command}` failed: {error}; {hint}{FALLBACK_HINT}")


def process_start_time(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot), None if it is gone or a
    zombie: with the pid it names a process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in "ZX" else int(fields[19])


def _check_prefix(prefix: str) -> None:
    # letters only, so the pid that follows the prefix in a name parses unambiguously
    if not re.fullmatch(r"[a-z]{1,16}", prefix):
        raise ValueError(f"netns prefix must be 1-16 lowercase letters, got {prefix!r}")


def _owner_gone(pid: str, started: str) -> bool:
    return process_start_time(int(pid)) != int(started)


def stale_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces named by `prefix` whose creating process is gone (by pid and start time, so
    a reused pid does not keep them)."""
    _check_prefix(prefix)
    owned = re.compile(rf"{prefix}(\d+)-(\d+)-[0-9a-f]+-(r\d+|sw)")
    names = os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []
    return [n for n in sorted(names) if (m := owned.fullmatch(n)) and _owner_gone(m[1], m[2])]


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete the stale namespaces of `prefix`; return the names that are gone (one that
    cannot be deleted, e.g. without root, stays in `stale_namespaces`).

    Deleting a namespace destroys the bridge, veths and qdiscs inside it, so nothing else leaks.
    """
    stale = stale_namespaces(prefix)
    for name in stale:
        _run(f"ip netns delete {name}", check=False)
    return [n for n in stale if not os.path.exists(os.path.join(NETNS_DIR, n))]


def _delete_namespaces(created: list[str], owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return  # a forked child must not tear down its parent's link
    while created:
        _run(f"ip netns delete {created.pop()}", check=False)


def enter_netns(name: str) -> None:
    """Move the calling thread into the named network namespace.

    Call first thing in a fresh rank process, before creating sockets or threads: setns changes
    only the calling thread, and threads and sockets created afterwards inherit its namespace.
    """
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):
            os.setns(fd, CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)  # Python 3.11 has no os.setns
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into netns {name!r}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class NetnsLink:
    """N namespaces, one per rank, joined by a bridge; every link direction shaped by tc tbf.

    The bridge lives in its own "switch" namespace rather than the root one, so a run adds nothing
    to the host's interfaces and deleting the namespaces removes every bridge, veth and qdisc.
    Traffic from rank a to rank b is shaped twice: on a's egress (a's uplink) and on the switch
    port towards b (b's downlink), so N-to-1 traffic also queues like it would on a real NIC.
    A rank process joins with `enter_netns(link.netns_name(rank))`, then uses
    GLOO_SOCKET_IFNAME=`link.ifname` and MASTER_ADDR=`link.rank_addr(0)`.
    """

    ifname = "eth0"  # same in every rank namespace, so GLOO_SOCKET_IFNAME is one value
    subnet = "10.77.0"  # each link is its own L2 island, so every link can use the same one

    def __init__(self, num_ranks: int, rate: str, prefix: str = DEFAULT_PREFIX) -> None:
        _check_prefix(prefix)
        if not 1 <= num_ranks <= 253:
            raise ValueError(f"num_ranks must be in 1..253 (one /24 subnet), got {num_ranks}")
        self.num_ranks = num_ranks
        self.bytes_per_s = parse_rate(rate)
        self.rate = f"{round(self.bytes_per_s * 8)}bit"
        self.prefix = prefix
        pid = os.getpid()
        self._tag = f"{prefix}{pid}-{process_start_time(pid)}-{secrets.token_hex(3)}"
        self._created: list[str] = []
        # removes what was made when closed, collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, _delete_namespaces, self._created, pid)

    @property
    def switch_netns(self) -> str:
        return f"{self._tag}-sw"

    @property
    def burst_bytes(self) -> int:
        # 1 ms of traffic, at least one 64 KiB GSO packet (smaller buckets hold a fast link
        # below its rate: docs/tuning.md); larger ones let the first burst through free, which
        # flatters short transfers
        return max(round(self.bytes_per_s / 1000), 64 * 1024 + 1514)

    def netns_name(self, rank: int) -> str:
        self._check_rank(rank)
        return f"{self._tag}-r{rank}"

    def rank_addr(self, rank: int) -> str:
        """IPv4 address of `ifname` in the rank's namespace; rank 0's is the rendezvous address."""
        self._check_rank(rank)
        return f"{self.subnet}.{rank + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Argv prefix that runs a command inside the rank's namespace."""
        return ["ip", "netns", "exec", self.netns_name(rank)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"rank {rank} out of range for {self.num_ranks} ranks")

    def _shape(self, netns: str, dev: str) -> None:
        # the latency bound caps the queue; TCP small queues keep senders far below it anyway
        tbf = f"tbf rate {self.rate} burst {self.burst_bytes} latency 50ms"
        _run(f"tc -n {netns} qdisc add dev {dev} root {tbf}")

    def __enter__(self) -> NetnsLink:
        if os.geteuid() != 0:
            raise LinkUnavailable(f"network namespaces need root; {FALLBACK_HINT}")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LinkUnavailable(f"no `{tool}` binary (iproute2) on PATH; {FALLBACK_HINT}")
        cleanup_stale(self.prefix)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        sw, eth = self.switch_netns, self.ifname
        self._add_netns(sw)
        # nf_call_* 0: bridged frames skip iptables even where br_netfilter is loaded
        nf_off = "nf_call_iptables 0 nf_call_ip6tables 0 nf_call_arptables 0"
        _run(f"ip -n {sw} link add br0 type bridge {nf_off}")
        _run(f"ip -n {sw} link set br0 up")
        for rank in range(self.num_ranks):
            ns, port = self.netns_name(rank), f"port{rank}"
            self._add_netns(ns)
            _run(f"ip -n {sw} link add {port} type veth peer name {eth} netns {ns}")
            _run(f"ip -n {sw} link set {port} master br0 up")
            _run(f"ip -n {ns} addr add {self.rank_addr(rank)}/24 dev {eth}")
            _run(f"ip -n {ns} link set {eth} up")
            _run(f"ip -n {ns} link set lo up")
            self._shape(ns, eth)
            self._shape(sw, port)

    def _add_netns(self, name: str) -> None:
        _run(f"ip netns add {name}")
        self._created.append(name)

    def close(self) -> None:
        """Delete every namespace this link made (and with them its bridge, veths, qdiscs)."""
        self._finalizer()  # runs once; later calls do nothing

    def __exit__(self, *exc: object) -> None:
        self.close()
