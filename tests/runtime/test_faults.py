"""Faults: Ctrl-C or an error inside a step leaves the engine as it was, an interrupted command
line prints one line and leaves no process behind, and a killed owner's network namespaces are
removed by `moe-overlap cleanup` or the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.distributed.netns import (
    NetnsLink,
    cleanup_stale,
    process_start_time,
)
from moe_overlap.tools.cli import main
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, netns_names, reference

LONG = [[(3 * i + j) % 80 for i in range(40)] for j in range(6)]
LONG_PARAMS = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
SLOW_LINK = "model:1gbit,20ms"  # every all-to-all takes 20 ms: a step is mostly waiting


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig(**TINY["qwen3_moe"])


@pytest.fixture(scope="module")
def expected(cfg):
    return reference(cfg)


def record_steps(llm: LLM, on_step=None) -> list[int]:
    """Wrap the engine's executor: the returned list collects the tokens each step feeds, and
    ``on_step(n)`` runs before the n-th step (from 1) is handed on."""
    step, fed = llm.executor.step, []

    def recorded_step(request):
        fed.append(sum(b.input_ids.numel() for b in request.batches))
        if on_step is not None:
            on_step(len(fed))
        return step(request)

    llm.executor.step = recorded_step
    return fed


def interrupt_at_step(llm: LLM, step: int, delay_s: float | None) -> list[int]:
    """A SIGINT hits this process in the ``step``-th step: at once (``delay_s=None``, before
    the step runs) or ``delay_s`` later, once the step's batches were sent and the driver waits
    for the ranks' replies."""

    armed = [True]

    def interrupt(n: int) -> None:
        if n != step or not armed:
            return
        armed.pop()
        if delay_s is None:
            os.kill(os.getpid(), signal.SIGINT)
        else:
            threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGINT)).start()

    return record_steps(llm, interrupt)


def check_next_calls(llm: LLM, expected, fed: list[int]) -> None:
    for case, prompts in CASES.items():
        fed.clear()
        assert_same(expected[case], llm.generate(prompts, PARAMS, return_logits=True))
        # only this call's requests ran: every prompt token once, then one per new token
        new_tokens = sum(len(p) + PARAMS.max_new_tokens - 1 for p in prompts)
        assert sum(fed) == new_tokens, f"{case}: another call's requests ran in this one"


def interrupt_between_replies(llm: LLM, from_step: int) -> None:
    """A SIGINT hits this process just as rank 0's reply to a step (the ``from_step``-th or
    a later one) is read while rank 1's is not yet."""
    conns, counts, armed = llm.executor.conns, [0, 0], [True]

    def counted(rank: int):
        recv = conns[rank].recv

        def recv_then_interrupt():
            reply = recv()
            counts[rank] += 1
            if rank == 0 and armed and counts[0] >= from_step and counts[1] < counts[0]:
                armed.pop()
                os.kill(os.getpid(), signal.SIGINT)
            return reply

        return recv_then_interrupt

    for rank in (0, 1):
        conns[rank].recv = counted(rank)


@pytest.mark.timeout(120)
def test_ctrl_c_during_generate_at_ep2_leaves_engine_as_before(cfg, expected):
    # a short collective timeout: a driver waiting for a reply that never comes fails fast
    with LLM(config=cfg, ep=2, link=SLOW_LINK, timeout_s=5, max_num_seqs=4, **KW) as llm:
        fed = interrupt_at_step(llm, step=3, delay_s=0.005)  # while waiting for both replies
        with pytest.raises(KeyboardInterrupt):
            llm.generate(LONG, LONG_PARAMS)
        check_next_calls(llm, expected, fed)
        interrupt_between_replies(llm, from_step=3)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(LONG, LONG_PARAMS)
        check_next_calls(llm, expected, fed)


def test_ctrl_c_during_generate_at_ep1_drops_the_calls_requests(cfg, expected):
    with LLM(config=cfg, max_num_seqs=4, **KW) as llm:
        fed = interrupt_at_step(llm, step=3, delay_s=None)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(LONG, LONG_PARAMS)
        check_next_calls(llm, expected, fed)


def test_failure_inside_a_step_leaves_engine_as_before(cfg, expected):
    # a forward that raises stops the call; one request's own fault (its sampling) does not,
    # see test_engine.py::test_a_request_that_fails_in_a_step_fails_alone
    with LLM(config=cfg, max_num_seqs=4, **KW) as llm:
        failures = [1]

        def failing_once(n: int) -> None:
            if n == 3 and failures:
                failures.pop()
                raise RuntimeError("forward failed")

        fed = record_steps(llm, on_step=failing_once)
        with pytest.raises(RuntimeError, match="forward failed"):
            llm.generate(LONG, LONG_PARAMS)
        check_next_calls(llm, expected, fed)


def _wrapped_cli(marker: str) -> str:
    """A ``moe-overlap`` run that prints ``marker`` to stdout when generation starts."""
    return (
        "import sys\n"
        "from moe_overlap.engine.llm import LLM\n"
        "from moe_overlap.tools.cli import main\n"
        "generate = LLM.generate\n"
        "def announced(self, *a, **kw):\n"
        f"    print({marker!r}, flush=True)\n"
        "    return generate(self, *a, **kw)\n"
        "LLM.generate = announced\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: the ranks are children of the rank fork server."""
    children = _children(pid)
    return children + [d for c in children for d in _descendants(c)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in "ZX"


@pytest.mark.timeout(120)
def test_ctrl_c_in_cli_prints_one_line_and_stops_the_ranks():
    args = ["generate", "--hf-config", "configs/qwen3-moe-tiny.json", "--ep", "2"]
    args += ["--link", "model:1gbit,50ms", "--max-new-tokens", "60", "--ignore-eos"]
    args += ["--prompt-ids", ",".join(map(str, LONG[0]))]
    cli = subprocess.Popen(
        [sys.executable, "-c", _wrapped_cli("generating"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert cli.stdout is not None and cli.stdout.readline().strip() == "generating"
        ranks = _descendants(cli.pid)
        assert len(ranks) == 3  # the fork server and two ranks
        time.sleep(0.2)
        os.killpg(cli.pid, signal.SIGINT)  # Ctrl-C reaches the driver and its ranks
        _, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
    assert err.strip().splitlines() == ["moe-overlap: interrupted"], err
    assert cli.returncode == 130
    # the ranks end with the command: their own exit may lag its by a moment on a loaded machine
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in ranks if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, "a rank or the fork server outlived the command by 10 s"


# Holds a link until killed, to leave leftovers like a crashed launcher would.
HOLDER = """
import signal, sys, time
from moe_overlap.distributed.netns import NetnsLink
if len(sys.argv) > 2:  # what an entry point does (the CLI does): SIGTERM unwinds and exits
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
link = NetnsLink(2, "100mbit", prefix=sys.argv[1]).__enter__()
print(" ".join([link.switch_netns, link.netns_name(0), link.netns_name(1)]), flush=True)
time.sleep(60)
"""


def session_prefix(tag: str) -> str:
    """A namespace prefix of this test session alone (letters only, as prefixes must be)."""
    return tag + "".join(chr(ord("a") + int(d)) for d in str(os.getpid()))


def holder(prefix: str, *args: str) -> tuple[subprocess.Popen, set[str]]:
    """A process holding a 2-rank link under ``prefix``, and the namespaces it made."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, prefix, *args], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, set(proc.stdout.readline().split())


def test_cleanup_command_and_next_run_remove_a_killed_owners_namespaces(netns_ok, capsys):
    by_command, by_next_run = session_prefix("moeocmd"), session_prefix("moeonext")
    holders = [holder(by_command), holder(by_next_run)]
    left_for_command, left_for_next_run = (made for _, made in holders)
    with NetnsLink(1, "1gbit", prefix=by_command) as alive:
        for proc, _ in holders:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert len(left_for_command | left_for_next_run) == 6
        assert left_for_command | left_for_next_run <= netns_names()
        capsys.readouterr()
        assert main(["cleanup", "--prefix", by_command]) == 0
        out = capsys.readouterr().out
        assert "removed 3 network namespace(s)" in out
        assert all(name in out for name in left_for_command)
        assert not left_for_command & netns_names()
        assert alive.netns_name(0) in netns_names()  # a running engine's link is kept
    assert left_for_next_run <= netns_names()
    with NetnsLink(1, "1gbit", prefix=by_next_run):  # what a --link netns run does first
        assert not left_for_next_run & netns_names()


def test_namespace_of_a_reused_pid_is_stale(netns_ok):
    prefix = session_prefix("moeoreuse")
    start = process_start_time(os.getpid())
    assert start is not None
    reused = f"{prefix}{os.getpid()}-{start + 1}-abc123-r0"  # a live pid, another process
    ours = f"{prefix}{os.getpid()}-{start}-abc123-r0"
    for name in (reused, ours):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert cleanup_stale(prefix) == [reused]
        assert reused not in netns_names() and ours in netns_names()
    finally:
        for name in (reused, ours):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_sigterm_of_owner_removes_its_namespaces(netns_ok):
    proc, made = holder(session_prefix("moeoterm"), "exit-on-sigterm")
    proc.terminate()
    assert proc.wait(timeout=20) == 143
    assert len(made) == 3 and not made & netns_names()
