"""The emulated cross-node link that expert-parallel ranks talk over (DESIGN.md section 7).

`--link none` is plain loopback; `--link netns:RATE` puts each rank in its own network namespace
on a private bridge shaped by `tc tbf`; `--link model:BANDWIDTH,LATENCY` adds a modelled delay to
each collective where namespaces are not permitted.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Literal

NETNS_DIR = "/var/run/netns"  # where `ip netns add` bind-mounts the namespaces it names
CLONE_NEWNET = 0x40000000
FALLBACK_HINT = "use --link model:BANDWIDTH,LATENCY (e.g. model:2gbit,50us) instead"

# tc's rate units (case-insensitive, as tc reads them); note `mbps` is megaBYTES per second.
_RATE_BITS = {"bit": 1.0, "bps": 8.0}
for _i, _p in enumerate("kmgt", start=1):
    _RATE_BITS |= {f"{_p}bit": 1000.0**_i, f"{_p}ibit": 1024.0**_i}
    _RATE_BITS |= {f"{_p}bps": 8 * 1000.0**_i, f"{_p}ibps": 8 * 1024.0**_i}
_TIME_S = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUMBER_UNIT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([a-z]+)")
_FORMS = "none | netns:RATE (e.g. netns:2gbit) | model:BANDWIDTH,LATENCY (e.g. model:2gbit,50us)"
_RATE_EXAMPLES = "2gbit, 500mbit, 100kbit, 100mbps (tc units: bit/s, or bps = bytes/s)"


def parse_rate(text: str) -> float:
    """Parse a tc rate such as `2gbit` or `100mbps` into bytes per second."""
    match = _NUMBER_UNIT.fullmatch(text.strip().lower())
    if match is None or match[2] not in _RATE_BITS or float(match[1]) <= 0:
        raise ValueError(
            f"bad rate {text!r}: expected a positive number and unit, e.g. {_RATE_EXAMPLES}"
        )
    return float(match[1]) * _RATE_BITS[match[2]] / 8


def parse_latency(text: str) -> float:
    """Parse a latency such as `50us`, `2ms` or `0.1s` into seconds."""
    match = _NUMBER_UNIT.fullmatch(text.strip().lower())
    if match is None or match[2] not in _TIME_S:
        raise ValueError(f"bad latency {text!r}: expected a number and us/ms/s, e.g. 50us, 2ms")
    return float(match[1]) * _TIME_S[match[2]]


@dataclass(frozen=True)
class LinkSpec:
    """What `--link` asked for: no link, a shaped namespace link, or a modelled delay."""

    kind: Literal["none", "netns", "model"]
    bytes_per_s: float | None = None
    latency_s: float = 0.0
    spec: str = ""  # the text as given, for reports that must say which link ran

    def __post_init__(self) -> None:
        if self.kind not in ("none", "netns", "model"):
            raise ValueError(f"unknown link kind {self.kind!r}; accepted: {_FORMS}")
        rate_ok = self.bytes_per_s is None if self.kind == "none" else (self.bytes_per_s or 0) > 0
        if not rate_ok or self.latency_s < 0:
            raise ValueError(f"{self.kind} link needs a rate > 0 (none: no rate), latency >= 0")


def parse_link(spec: str) -> LinkSpec:
    """Parse the CLI value of `--link`; raise ValueError naming the value and the accepted forms."""
    kind, _, arg = spec.strip().partition(":")
    try:
        if kind == "none" and not arg:
            return LinkSpec("none", spec=spec)
        if kind == "netns" and arg:
            return LinkSpec("netns", parse_rate(arg), spec=spec)
        if kind == "model" and arg.count(",") == 1:
            bandwidth, latency = arg.split(",")
            return LinkSpec("model", parse_rate(bandwidth), parse_latency(latency), spec=spec)
    except ValueError as error:
        raise ValueError(f"bad --link {spec!r}: {error}; accepted: {_FORMS}") from None
    raise ValueError(f"bad --link {spec!r}; accepted: {_FORMS}")


@dataclass
class ModelledLink:
    """A link that exists only as arithmetic: delay = latency + bytes / bandwidth."""

    bytes_per_s: float
    latency_s: float = 0.0

    @classmethod
    def from_spec(cls, spec: LinkSpec) -> ModelledLink:
        if spec.kind != "model" or spec.bytes_per_s is None:
            raise ValueError(f"not a model link: {spec.spec!r}")
        return cls(spec.bytes_per_s, spec.latency_s)

    def delay_for(self, num_bytes: int) -> float:
        """Seconds a transfer of `num_bytes` (the busiest direction of one rank) takes."""
        return self.latency_s + num_bytes / self.bytes_per_s

    def __post_init__(self) -> None:
        self._free_at = 0.0  # when this rank's link finishes what is already queued on it
        self._lock = threading.Lock()

    def reserve(self, start_time: float, num_bytes: int) -> float:
        """Queue a transfer issued at `start_time`; return when it completes.

        Transfers in flight at once share the link: each waits for those queued before it, as
        on one NIC, so two micro-batches' all-to-alls cannot both get the full bandwidth.
        """
        with self._lock:
            begin = max(start_time, self._free_at)
            self._free_at = begin + num_bytes / self.bytes_per_s
            return self._free_at + self.latency_s

    def sleep_until(self, end_time: float) -> None:
        remaining = end_time - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def wait_until(self, start_time: float, num_bytes: int) -> float:
        """Sleep until `start_time + delay_for(num_bytes)`; return the seconds slept.

        `start_time` is a `time.perf_counter()` reading taken when the collective was issued, so
        a collective that really took longer than the model costs nothing extra.
        """
        remaining = start_time + self.delay_for(num_bytes) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return max(remaining, 0.0)


class LinkUnavailable(RuntimeError):
    """Namespaces or tc shaping cannot be set up here."""


def _run(command: str, check: bool = True) -> None:
    """Run an iproute2 command line (our names never contain spaces)."""
    result = subprocess.run(command.split(), capture_output=True, text=True)
    if check and result.returncode != 0:
        hint = "tc tbf qdisc unavailable; " if command.startswith("tc") else ""
        error = result.stderr.strip()
        raise LinkUnavailable(f"`{command}` failed: {error}; {hint}{FALLBACK_HINT}")


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in "ZX"  # zombies are dead
    except (FileNotFoundError, IndexError):
        return False


def _check_prefix(prefix: str) -> None:
    # letters only, so the pid that follows the prefix in a name parses unambiguously
    if not re.fullmatch(r"[a-z]{1,16}", prefix):
        raise ValueError(f"netns prefix must be 1-16 lowercase letters, got {prefix!r}")


def cleanup_stale(prefix: str = "moeo") -> list[str]:
    """Delete namespaces named by `prefix` whose creating process is dead; return their names.

    Deleting a namespace destroys the bridge, veths and qdiscs inside it, so nothing else leaks.
    """
    _check_prefix(prefix)
    owned = re.compile(rf"{prefix}(\d+)-\d+-(r\d+|sw)")
    names = os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []
    stale = [n for n in names if (m := owned.fullmatch(n)) and not _pid_alive(int(m[1]))]
    for name in stale:
        _run(f"ip netns delete {name}", check=False)
    return stale


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


_live_links: set[NetnsLink] = set()  # closed at interpreter exit or on SIGTERM
_hooks_installed = False


def _close_live_links() -> None:
    for link in list(_live_links):
        link.close()


def _install_exit_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_live_links)
    previous = signal.getsignal(signal.SIGTERM)
    # signal handlers can only be set from the main thread; an ignored SIGTERM stays ignored
    in_main = threading.current_thread() is threading.main_thread()
    if not in_main or previous in (signal.SIG_IGN, None):
        return

    def on_sigterm(signum: int, frame: object) -> None:
        _close_live_links()
        if callable(previous):
            previous(signum, frame)
        else:  # default action: die by SIGTERM as before, now without leftovers
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)


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
    _instances = 0  # per-process counter that, with the pid, makes names unique

    def __init__(self, num_ranks: int, rate: str, prefix: str = "moeo") -> None:
        _check_prefix(prefix)
        if not 1 <= num_ranks <= 253:
            raise ValueError(f"num_ranks must be in 1..253 (one /24 subnet), got {num_ranks}")
        self.num_ranks = num_ranks
        self.bytes_per_s = parse_rate(rate)
        self.rate = f"{round(self.bytes_per_s * 8)}bit"
        self.prefix = prefix
        self._owner_pid = os.getpid()
        self._tag = f"{prefix}{self._owner_pid}-{NetnsLink._instances}"
        # each link is its own L2 island, so subnets cannot clash; varying it only aids reading logs
        self._subnet = f"10.77.{NetnsLink._instances % 256}"
        NetnsLink._instances += 1
        self._created: list[str] = []

    @property
    def switch_netns(self) -> str:
        return f"{self._tag}-sw"

    @property
    def burst_bytes(self) -> int:
        # 1 ms of traffic, at least one 64 KiB GSO packet (a 32 KiB bucket held 2gbit to 0.65x);
        # larger buckets let the first burst through free, which flatters short transfers
        return max(round(self.bytes_per_s / 1000), 64 * 1024 + 1514)

    def netns_name(self, rank: int) -> str:
        self._check_rank(rank)
        return f"{self._tag}-r{rank}"

    def rank_addr(self, rank: int) -> str:
        """IPv4 address of `ifname` in the rank's namespace; rank 0's is the rendezvous address."""
        self._check_rank(rank)
        return f"{self._subnet}.{rank + 1}"

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
        _install_exit_hooks()
        _live_links.add(self)
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
        if os.getpid() != self._owner_pid:
            return  # a forked child must not tear down its parent's link
        while self._created:
            _run(f"ip netns delete {self._created.pop()}", check=False)
        _live_links.discard(self)

    def __exit__(self, *exc: object) -> None:
        self.close()
