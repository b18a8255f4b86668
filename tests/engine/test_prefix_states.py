"""A hybrid model's prefix caching by recurrent states kept at page boundaries: where the
driver plans them and hands their entries on (no model), and, on one process, that a kept
state is the state after exactly its boundary and a restored slot continues from it. The
exactness on real gloo ranks is ``tests/engine/test_prefix_exact.py``."""

from __future__ import annotations

import torch

from moe_overlap import ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.step import PageOps
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.engine.scheduler import Scheduler
from moe_overlap.model import delta_rule
from moe_overlap.model.loader import build_model
from moe_overlap.runtime.model_runner import ModelRunner
from tests.engine.test_prefix_cache import PAGE, reply, request, run_out
from tests.engine.test_prefix_exact import one_thread, qwen3_5


def hybrid_scheduler(entries: int, pages: int = 32) -> Scheduler:
    return Scheduler(
        1, 8, 64, 1024, None, "round_robin", None, pages, PAGE, True, state_snapshots=entries
    )


def test_states_are_kept_at_the_prompts_last_page_and_a_branch_point_and_hits_end_there():
    sched = hybrid_scheduler(entries=1)
    cache = sched.prefix[0]
    sched.add(request(0, list(range(10))))  # its prompt's last full page ends at token 8
    step = sched.schedule()
    assert step.pages[0].snapshot == [(0, 8, 0)]
    run_out(sched, step)
    kept = [page for page in cache.pages.values() if page.entry is not None]
    assert [(page.key[1], page.entry) for page in kept] == [((4, 5, 6, 7), 0)]
    sched.add(request(1, list(range(10)) + [50]))
    step = sched.schedule()  # a hit ends at the kept state: two pages, the state after 8
    assert [len(ids) for _, ids in step.pages[0].attach] == [2]
    assert step.pages[0].restore == [(0, 0, 8)]
    assert step.scheduled[0][0][1] == 3  # only its own tokens are fed
    run_out(sched, step)
    # the first page alone has no state: no hit, and this request keeps one at the branch
    # point (token 4), the only entry taken from the least recently used idle page
    sched.add(request(2, [0, 1, 2, 3, 60, 61]))
    step = sched.schedule()
    assert step.pages[0].attach == [] and step.pages[0].snapshot == [(0, 4, 0)]
    assert all(page.entry is None for page in cache.pages.values())
    run_out(sched, step)
    assert [p.key[1] for p in cache.pages.values() if p.entry is not None] == [(0, 1, 2, 3)]
    cache.flush()  # an evicted page's entry is free again
    assert cache.states is not None and cache.states.free == [0]


def test_a_state_is_taken_from_an_idle_page_past_those_without_one_never_from_a_held_one():
    """Entries run out: a new branch point takes the state of the least recently used idle
    page that keeps one (past idle pages that keep none), but not while a request holds it."""
    sched = hybrid_scheduler(entries=1)
    cache = sched.prefix[0]
    sched.add(request(0, [90] * 13))  # three idle pages, the state the next one takes ...
    run_out(sched, sched.schedule())
    sched.add(request(1, list(range(10))))  # ... to keep it at token 8, on page (4..7)
    run_out(sched, sched.schedule())
    kept = [p for p in cache.pages.values() if p.entry is not None]
    assert [p.key[1] for p in kept] == [(4, 5, 6, 7)] and cache.evictable == 5
    sched.add(request(2, list(range(10)) + [50], new=3))  # a hit holds the page with it
    step = sched.schedule()
    sched.update(step, reply(step))
    sched.add(request(3, [0, 1, 2, 3, 60, 61]))  # a branch point at 4 finds no entry
    step = sched.schedule()
    assert step.pages[0].snapshot == [] and kept[0].entry == 0
    run_out(sched, step)  # request 2 lets go: its page's state is the one to take now
    sched.add(request(4, [0, 1, 2, 3, 70, 71]))
    assert sched.schedule().pages[0].snapshot == [(1, 4, 0)] and kept[0].entry is None


def test_a_decoding_request_keeps_its_state_at_its_last_decoded_page_boundary():
    """A 10-token prompt answered in 20 tokens of 2 (29 computed, pages of 4): a state at the
    prompt's last full page (8) and at each boundary a decode step crosses (12 ... 28), each
    handing the one before back once kept, so at most two decoded ones at a time; the last
    stays, and a second turn (prompt, answer and one more token) hits there."""
    sched = hybrid_scheduler(entries=8)
    states = sched.prefix[0].states
    assert states is not None
    sched.add(request(0, list(range(10)), new=20))
    step, most = sched.schedule(), 0
    while sched.has_work():
        sched.update(step, reply(step))
        step = sched.schedule()
        most = max(most, 8 - len(states.free))
    assert most == 3 and len(states.free) == 8 - 2
    sched.add(request(1, list(range(10)) + [2] * 20 + [50]))
    step = sched.schedule()
    assert [len(ids) for _, ids in step.pages[0].attach] == [7]
    assert [tokens for _, _, tokens in step.pages[0].restore] == [28]


def test_a_request_that_leaves_before_its_boundary_frees_its_entry():
    sched = hybrid_scheduler(entries=2)
    sched.add(request(0, list(range(12))))
    step = sched.schedule()
    assert step.pages[0].snapshot == [(0, 8, 0), (0, 12, 1)]  # the page before: an equal prompt
    sched.abort(list(sched.running[0]))
    states = sched.prefix[0].states
    assert states is not None and sorted(states.free) == [0, 1]
    assert sched.schedule().pages[0].snapshot == []


def test_a_kept_state_is_the_state_after_its_boundary_and_a_restored_slot_continues():
    """One 30-token prefill keeps the state after 16 tokens (inside the piece) and after 30
    (its end); slot 1 restored from the first computes tokens 16-29 as the whole run did."""
    cfg: ModelConfig = qwen3_5()
    with one_thread():
        runner_continues_from_kept_states(cfg)


def runner_continues_from_kept_states(cfg: ModelConfig) -> None:
    model = build_model(cfg, seed=0)
    runner = ModelRunner(model, LocalDispatcher(cfg.num_experts), 4, 64, state_snapshots=2)
    states = runner.states
    ids = torch.tensor([(7 * i + 3) % 80 for i in range(30)])
    states.apply_snapshots(PageOps(snapshot=[(0, 16, 0), (0, 30, 1)]))
    whole = runner.forward_plain(ForwardBatch(ids, [0], [0], [30], [True]))
    layer = next(iter(states.shapes))
    kept, end = states.snapshots.entry(layer, 0), states.snapshots.entry(layer, 1)
    torch.testing.assert_close(end, (states.conv[layer][0], states.ssm[layer][0]))
    runner.forward_plain(ForwardBatch(ids[:16], [2], [0], [16], [True]))
    torch.testing.assert_close(
        kept, (states.conv[layer][2], states.ssm[layer][2]), rtol=0, atol=1e-5
    )
    runner.kv_cache.reserve([1], [16])  # the prefix's KV, as an attached page would hold it
    runner.forward_plain(ForwardBatch(ids[:16], [1], [0], [16], [True]))
    for i in states.shapes:  # what the slot held is overwritten by the restore
        states.ssm[i][1].fill_(3.0)
        states.absorbed[i][1] = 5
    states.apply_snapshots(PageOps(restore=[(1, 0, 16)]))
    assert all(states.absorbed[i][1] == 16 for i in states.shapes)
    rest = runner.forward_plain(ForwardBatch(ids[16:], [1], [16], [14], [True]))
    torch.testing.assert_close(rest, whole[16:], rtol=0, atol=1e-4)


def test_the_delta_rule_reads_a_kept_state_off_its_chunk():
    """The state after any first tokens of a piece, wherever the piece starts on the chunk
    grid, is the state of the piece cut there (a chunk's first token, its last, the grid)."""
    with one_thread():
        states_read_off_chunks_match_cut_pieces()


def states_read_off_chunks_match_cut_pieces() -> None:
    gen = torch.Generator().manual_seed(0)
    n, h, dk, dv = 150, 3, 8, 6
    q, k = (delta_rule.l2_normalize(torch.randn(n, h, dk, generator=gen)) for _ in range(2))
    v, state = torch.randn(n, h, dv, generator=gen), torch.randn(h, dk, dv, generator=gen)
    g, beta = -0.3 * torch.rand(n, h, generator=gen), torch.rand(n, h, generator=gen)
    for start in (0, 37):
        keep = [1, 27, 64, 100, 149]
        out, end, kept = delta_rule.chunked(q, k, v, g, beta, state, start, keep)
        whole = delta_rule.chunked(q, k, v, g, beta, state, start)[:2]
        torch.testing.assert_close((out, end), whole, rtol=0, atol=1e-5)
        for r, got in zip(keep, kept, strict=True):
            cut = delta_rule.chunked(q[:r], k[:r], v[:r], g[:r], beta[:r], state, start)[1]
            torch.testing.assert_close(got, cut, rtol=0, atol=1e-5)
