"""The emulated link: `--link` parsing, the tc-shaped namespace link, and the modelled link.

What a killed or stopped owner leaves behind is tested in test_faults.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

from moe_overlap.distributed import netns as netns_mod
from moe_overlap.distributed.link import LinkSpec, parse_link
from moe_overlap.distributed.modelled_link import ModelledLink
from moe_overlap.distributed.netns import LinkUnavailable, NetnsLink, enter_netns
from tests.helpers import netns_names

# One side of a timed TCP transfer; run inside a namespace through `ip netns exec`.
XFER = """
import socket, sys, time
role, addr, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "recv":
    server = socket.create_server((addr, 5000))
    print("ready", flush=True)
    conn, _ = server.accept()
    got = 0
    while chunk := conn.recv(1 << 20):
        got += len(chunk)
    conn.sendall(b"k")
    print(got, flush=True)
else:
    payload = b"x" * size
    start = time.perf_counter()
    with socket.create_connection((addr, 5000), timeout=20) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
    print(time.perf_counter() - start, flush=True)
"""


def link_names(*netns: str) -> set[str]:
    cmd = ["ip", *(["-n", netns[0]] if netns else []), "-o", "link", "show"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def tcp_transfer(link: NetnsLink, size: int) -> float:
    """Send `size` bytes from rank 0 to rank 1; return the sender's seconds until acknowledged."""
    recv_cmd = [*link.exec_prefix(1), sys.executable, "-c", XFER, "recv", link.rank_addr(1), "0"]
    receiver = subprocess.Popen(recv_cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        send_cmd = [*link.exec_prefix(0), sys.executable, "-c", XFER, "send", link.rank_addr(1)]
        sender = subprocess.run([*send_cmd, str(size)], capture_output=True, text=True, timeout=30)
        assert sender.returncode == 0, sender.stderr
        assert int(receiver.stdout.readline()) == size
        return float(sender.stdout)
    finally:
        receiver.kill()
        receiver.wait()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("none", LinkSpec("none", spec="none")),
        ("netns:2gbit", LinkSpec("netns", 2e9 / 8, spec="netns:2gbit")),
        ("netns:500mbit", LinkSpec("netns", 500e6 / 8, spec="netns:500mbit")),
        ("netns:100mbps", LinkSpec("netns", 100e6, spec="netns:100mbps")),
        ("netns:1.5Gbit", LinkSpec("netns", 1.5e9 / 8, spec="netns:1.5Gbit")),
        ("netns:1kibit", LinkSpec("netns", 1024 / 8, spec="netns:1kibit")),
        ("netns:800bit", LinkSpec("netns", 100, spec="netns:800bit")),
        ("model:2gbit,50us", LinkSpec("model", 2e9 / 8, 50e-6, spec="model:2gbit,50us")),
        ("model:1GBps,2ms", LinkSpec("model", 1e9, 2e-3, spec="model:1GBps,2ms")),
        ("model:10mbit,0.5s", LinkSpec("model", 10e6 / 8, 0.5, spec="model:10mbit,0.5s")),
        ("model:10mbit,0us", LinkSpec("model", 10e6 / 8, 0.0, spec="model:10mbit,0us")),
        (
            "model:2gbit,50us,globaltimer",
            LinkSpec("model", 2e9 / 8, 50e-6, "model:2gbit,50us,globaltimer", "globaltimer"),
        ),
    ],
)
def test_parse_link_accepts(spec: str, expected: LinkSpec) -> None:
    parsed = parse_link(spec)
    assert parsed.kind == expected.kind and parsed.spec == spec
    assert parsed.bytes_per_s == pytest.approx(expected.bytes_per_s)
    assert parsed.latency_s == pytest.approx(expected.latency_s)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "loopback",
        "none:1gbit",
        "netns",
        "netns:",
        "netns:2",  # tc would read bit/s; we insist on a unit
        "netns:2gb",
        "netns:gbit",
        "netns:0gbit",
        "netns:-1gbit",
        "netns:2 gbit,",
        "model:2gbit",
        "model:2gbit,",
        "model:2gbit,50",
        "model:2gbit,50ns",
        "model:50us,2gbit",
        "model:2gbit,50us,1ms",
        "model:2gbit,50us,spin",
        "model:2gbit,50us,host,sleep",
        "model:0mbit,1ms",
        "model:2gbit,-1ms",
    ],
)
def test_parse_link_rejects_with_clear_message(spec: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_link(spec)
    assert repr(spec) in str(caught.value) and "model:BANDWIDTH,LATENCY" in str(caught.value)


def test_bad_rate_message_shows_examples() -> None:
    with pytest.raises(ValueError, match=r"'2gb'.*2gbit, 500mbit"):
        parse_link("netns:2gb")
    with pytest.raises(ValueError, match="'7'"):
        NetnsLink(2, "7")


def test_netns_link_hands_tc_exact_bits_and_checks_arguments() -> None:
    assert NetnsLink(2, "2gbit").rate == "2000000000bit"
    assert NetnsLink(2, "1MiBps").rate == f"{8 * 1024 * 1024}bit"
    with pytest.raises(ValueError, match="num_ranks"):
        NetnsLink(0, "1gbit")
    with pytest.raises(ValueError, match="prefix"):
        NetnsLink(2, "1gbit", prefix="moe0")
    with pytest.raises(IndexError):
        NetnsLink(2, "1gbit").rank_addr(2)


def test_modelled_link_delay_and_queueing() -> None:
    model = ModelledLink.from_spec(parse_link("model:8mbit,2ms"))  # 1 MB/s
    start = time.perf_counter()
    first = model.reserve(start, 20_000)  # 20 ms on the wire, 2 ms latency
    assert first == pytest.approx(start + 0.022)
    second = model.reserve(start, 10_000)  # queued behind the first, as on one NIC
    assert second == pytest.approx(start + 0.032)
    model.sleep_until(first)
    assert time.perf_counter() >= first
    late = time.perf_counter()
    model.sleep_until(late - 1.0)  # already late: no sleep
    assert time.perf_counter() - late < 0.01
    with pytest.raises(ValueError, match="not a model link"):
        ModelledLink.from_spec(parse_link("netns:1gbit"))


def test_unavailable_errors_suggest_model_link(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LinkUnavailable, match="root.*model:BANDWIDTH,LATENCY"):
        NetnsLink(2, "1gbit").__enter__()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns_mod.shutil, "which", lambda tool: None)
    with pytest.raises(LinkUnavailable, match="no `ip` binary.*model:BANDWIDTH"):
        NetnsLink(2, "1gbit").__enter__()


def test_failed_shaping_cleans_up_and_says_tbf(netns_ok: None) -> None:
    class BrokenTc(NetnsLink):
        def _shape(self, netns: str, dev: str) -> None:
            netns_mod._run(f"tc -n {netns} qdisc add dev {dev} root nosuchqdisc")

    link = BrokenTc(2, "1gbit")
    with pytest.raises(LinkUnavailable, match="tbf qdisc unavailable.*model:BANDWIDTH"):
        link.__enter__()
    assert not {link.switch_netns, link.netns_name(0)} & netns_names()


def test_netns_link_connects_ranks_and_removes_everything(netns_ok: None) -> None:
    root_links = link_names()
    link = NetnsLink(2, "1gbit")
    with link:
        made = {link.switch_netns, link.netns_name(0), link.netns_name(1)}
        assert made <= netns_names()
        assert {"br0", "port0", "port1"} <= link_names(link.switch_netns)
        assert link_names(link.netns_name(1)) == {"lo", link.ifname}
        assert link.rank_addr(0) != link.rank_addr(1)
        tcp_transfer(link, 1000)
    assert not made & netns_names()
    assert link_names() == root_links  # nothing was ever added to the host's namespace
    link.close()  # idempotent


def _list_interfaces(netns: str, queue: mp.Queue) -> None:
    enter_netns(netns)
    queue.put(sorted(name for _, name in socket.if_nameindex()))


def test_enter_netns_shows_only_namespace_interfaces(netns_ok: None) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with NetnsLink(1, "1gbit") as link:
        child = ctx.Process(target=_list_interfaces, args=(link.netns_name(0), queue))
        child.start()
        assert queue.get(timeout=20) == ["eth0", "lo"]
        child.join(timeout=20)


def test_shaping_is_real(netns_ok: None) -> None:
    size = 4 << 20
    with NetnsLink(2, "100mbit") as link:
        elapsed = tcp_transfer(link, size)
    ideal = size / link.bytes_per_s
    print(f"\n4 MiB TCP at 100mbit: {elapsed * 1e3:.0f} ms, size/rate {ideal * 1e3:.0f} ms")
    assert 0.5 * ideal < elapsed < 3 * ideal


def _gloo_rank(rank: int, netns: str, ifname: str, master: str, queue: mp.Queue) -> None:
    enter_netns(netns)
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29500", rank=rank, world_size=2)
    total = torch.ones(4)
    dist.all_reduce(total)
    send = torch.full((4 << 20,), float(rank))  # 16 MiB per rank, half of it crosses the link
    recv = torch.empty_like(send)
    half = send.numel() // 2
    mine, theirs = (send[half:], recv[half:]) if rank == 0 else (send[:half], recv[:half])
    dist.all_to_all_single(recv, send)  # warm-up
    times: dict[str, list[float]] = {"all_to_all_single": [], "irecv then isend": []}
    exchanged = True
    for name, samples in times.items():
        recv.fill_(-1)
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            if name == "all_to_all_single":
                dist.all_to_all_single(recv, send)
            else:  # the same exchange with the receive posted before the send
                pending = [dist.irecv(theirs, 1 - rank), dist.isend(mine, 1 - rank)]
                for work in pending:
                    work.wait()
            samples.append(time.perf_counter() - start)
        exchanged &= bool((theirs == 1 - rank).all())  # the peer's chunk arrived in place
    queue.put((rank, total.tolist(), exchanged, times))
    dist.destroy_process_group()


def test_gloo_all_to_all_over_link(netns_ok: None) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with NetnsLink(2, "1gbit") as link:
        args = [(r, link.netns_name(r), link.ifname, link.rank_addr(0), queue) for r in range(2)]
        ranks = [ctx.Process(target=_gloo_rank, args=a) for a in args]
        for process in ranks:
            process.start()
        try:
            results = sorted(queue.get(timeout=60) for _ in ranks)
        finally:
            for process in ranks:
                process.join(timeout=10)
                process.kill()
    assert [r[1] for r in results] == [[2.0] * 4] * 2 and all(r[2] for r in results)
    ideal = (8 << 20) / link.bytes_per_s  # 8 MiB each way over a full-duplex link
    print(f"\n16 MiB/rank exchange at 1gbit, size/rate {ideal * 1e3:.0f} ms:")
    for name, rank0_times in results[0][3].items():
        slowest = [max(a, b) for a, b in zip(rank0_times, results[1][3][name], strict=True)]
        print(f"  {name}: {', '.join(f'{t * 1e3:.0f}' for t in slowest)} ms")
        assert min(slowest) > 0.5 * ideal
