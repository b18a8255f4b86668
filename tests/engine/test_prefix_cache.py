"""Prefix caching in the scheduler (no model): which pages are shared, when they are cached,
hit counting, LRU eviction under a small pool, and flush; the exactness on real gloo ranks is
``tests/engine/test_prefix_exact.py``."""

from __future__ import annotations

from moe_overlap.core.step import GroupReply, StepReply
from moe_overlap.engine.kv_pages import CachedPage
from moe_overlap.engine.request import Request, SamplingParams
from moe_overlap.engine.scheduler import Scheduler
from moe_overlap.engine.window_pages import WindowPages

PAGE = 4


def scheduler(pages: int, budget: int = 1024) -> Scheduler:
    return Scheduler(1, 8, 64, budget, None, "round_robin", None, pages, PAGE, prefix_caching=True)


def request(i: int, prompt: list[int], new: int = 2) -> Request:
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    return Request(i, prompt, params)


def reply(step) -> StepReply:
    """Every scheduled sequence samples token 2."""
    n = len(step.scheduled[0])
    return StepReply([GroupReply([2] * n, [None] * n, [None] * n, [[]] * n)], [None])


def run_out(sched: Scheduler, step, published: list[int] | None = None):
    """Steps until nothing runs; returns the last step (its page ops unsent). ``published``
    gathers the page indices every step cached."""
    while sched.has_work():
        sched.update(step, reply(step))
        step = sched.schedule()
        if published is not None:
            published += [index for _, index, _ in step.pages[0].publish]
    return step


def test_full_computed_pages_are_shared_and_the_last_token_is_always_computed():
    sched = scheduler(pages=16)
    sched.add(request(0, list(range(10))))  # 10 + 2 tokens: pages 0-1 full, 2 partial
    published: list[int] = []
    run_out(sched, sched.schedule(), published)
    cache = sched.prefix[0]
    assert len(cache.pages) == 2 and cache.evictable == 2  # no request holds them now
    assert published == [0, 1]
    sched.add(request(1, list(range(10)) + [50, 51]))  # its first 8 tokens are cached
    sched.add(request(2, list(range(8))))  # 8 tokens: the last one is computed, so 1 page
    step = sched.schedule()
    (_, fed1), (_, fed2) = step.scheduled[0]
    assert (fed1, fed2) == (4, 4)  # each prefills only past its cached pages
    assert [len(ids) for _, ids in step.pages[0].attach] == [2, 1]
    assert (cache.queries, cache.hits) == (10 + 12 + 8, 8 + 4)


def test_a_page_still_being_written_is_not_shared():
    sched = scheduler(pages=16, budget=6)  # a 6-token chunk: page 1 is half written
    sched.add(request(0, list(range(12))))
    step = sched.schedule()
    sched.update(step, reply(step))
    sched.add(request(1, list(range(12))))
    step = sched.schedule()
    assert [index for _, index, _ in step.pages[0].publish] == [0]  # page 1 is not full yet
    assert [len(ids) for _, ids in step.pages[0].attach] == [1]  # the new request: page 0 only
    assert sched.running[0][1].num_computed == PAGE


def test_idle_cached_pages_are_evicted_least_recently_used_when_the_pool_is_short():
    sched = scheduler(pages=6)
    sched.add(request(0, list(range(10))))  # caches 2 pages, frees its partial one
    run_out(sched, sched.schedule())
    sched.add(request(1, [70] * 9))  # 11 tokens: caches 2 more
    run_out(sched, sched.schedule())
    cache = sched.prefix[0]
    assert cache.evictable == 4 and sched.pages[0].free == 2
    sched.add(request(2, [60] * 14))  # 16 tokens: 4 pages, so two cached ones go
    step = sched.schedule()
    assert cache.evictions == 2 and len(step.pages[0].evict) == 2
    gone = {page_id for page_id in step.pages[0].evict}
    assert gone == {1, 2}  # request 0's: used least recently
    sched.add(request(3, [70] * 9))  # request 1's pages are still there
    assert cache.lookup([70] * 11, True) and not cache.lookup(list(range(10)), True)


def test_flush_forgets_every_cached_page_and_frees_those_in_use_when_they_end():
    sched = scheduler(pages=16)
    sched.add(request(0, list(range(10))))
    run_out(sched, sched.schedule())
    sched.add(request(1, list(range(10)), new=4))
    step = sched.schedule()  # request 1 holds both cached pages
    cache = sched.prefix[0]
    assert cache.flush() == 0 and not cache.pages  # none idle: freed when request 1 ends
    step = run_out(sched, step)
    assert cache.evictions == 2 and not cache.lookup(list(range(10)), True)
    assert sched.pages[0].free + cache.evictable == 16


def test_a_preempted_request_finds_its_own_cached_pages_when_it_comes_back():
    sched = scheduler(pages=7)
    sched.add(request(0, list(range(8)), new=8))  # 2 pages at admission, 4 at the longest
    sched.add(request(1, [40 + i for i in range(8)], new=8))
    step = sched.schedule()
    while not sched.preemptions:
        sched.update(step, reply(step))
        step = sched.schedule()
    victim = sched.waiting[0]
    assert victim.request_id == 1 and victim.num_computed == 0 and not victim.cached
    while sched.waiting:  # request 0 finishes, request 1 comes back
        sched.update(step, reply(step))
        step = sched.schedule()
    assert victim.num_computed >= 2 * PAGE and victim.cached_tokens == 0  # its prompt's pages
    run_out(sched, step)
    assert victim.output_ids == [2] * 8
    # as vLLM's counters: each prompt is looked up once; a victim's own pages found again on
    # its way back are no hits (they would inflate the hit rate as the pool runs short)
    assert (sched.prefix[0].queries, sched.prefix[0].hits) == (8 + 8, 0)


def test_cache_aware_routing_sends_a_request_to_the_rank_holding_its_prefix():
    sched = Scheduler(2, 8, 64, 1024, None, "cache_aware", None, 16, PAGE, prefix_caching=True)
    p, q = list(range(10)), [50 + i for i in range(10)]
    sched.add(request(0, p))  # nothing cached anywhere: fewest requests, so ranks 0 and 1
    sched.add(request(1, q))
    step = sched.schedule()
    first = {r.request_id: r.rank for r in sum(sched.running, [])}
    while sched.has_work():
        n = [len(g) for g in step.scheduled]
        replies = [GroupReply([2] * k, [None] * k, [None] * k, [[]] * k) for k in n]
        sched.update(step, StepReply(replies, [None, None]))
        step = sched.schedule()
    sched.add(request(2, q + [7]))  # round robin would start at rank 0 again
    sched.add(request(3, p + [7]))
    sched.schedule()
    placed = {r.request_id: r.rank for r in sum(sched.running, [])}
    assert first == {0: 0, 1: 1} and placed == {2: 1, 3: 0}
    assert [c.hits for c in sched.prefix] == [8, 8]  # each found on the rank holding it


def test_a_slot_admitted_and_preempted_in_one_step_is_never_attached_on_the_rank():
    """The rank applies a step's page ops by kind (releases before attaches): a request
    preempted in the step that admitted it onto cached pages must not leave that attach behind,
    or the rank attaches pages to a slot the driver has freed (and refuses the next attach)."""
    sched = scheduler(pages=4)
    shared = list(range(8))  # two full pages, cached once request 0 ends
    sched.add(request(0, shared, new=1))
    run_out(sched, sched.schedule())
    sched.add(request(1, [40, 41, 42, 43], new=6))  # one page; its first decode needs a second
    step = sched.schedule()
    sched.update(step, reply(step))
    sched.add(request(2, [*shared, 9]))  # admitted onto the cached pages with the last free one
    step = sched.schedule()  # request 1's decode needs that page back: request 2 is preempted
    assert sched.preemptions == 1 and sched.waiting[0].request_id == 2
    ops = step.pages[0]
    assert not set(ops.released) & {slot for slot, _ in ops.attach}
    held: set[int] = {req.slot for req, _ in step.scheduled[0]}  # the slots the rank fills
    while sched.has_work():  # and on to the end, as the rank sees each step's ops
        sched.update(step, reply(step))
        step = sched.schedule()
        ops = step.pages[0]
        held -= set(ops.released)
        for slot, _ in ops.attach:
            assert slot not in held, f"slot {slot} attached while it holds pages"
            held.add(slot)
        held |= {req.slot for req, _ in step.scheduled[0]}


def test_a_hit_ends_where_the_sliding_window_before_it_is_kept():
    """Window 8, pages of 4: a hit of n pages reads pages n-2 and n-1 in the sliding layers;
    with page 5's sliding page given back, a 6-page chain is usable up to 5 pages, and with
    page 3's too, up to 3."""
    pool = WindowPages(8, 16, PAGE)
    chain = [CachedPage(i + 1, (i, ())) for i in range(6)]
    chain[5].window = False
    assert pool.usable(chain) == chain[:5]
    chain[3].window = False
    assert pool.usable(chain) == chain[:3]
