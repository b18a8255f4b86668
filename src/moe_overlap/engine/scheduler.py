"""Continuous batching with chunked prefill, for every attention-DP rank at once.

Each step, every rank gets a ForwardBatch: one token for each of its decoding requests, then
prompt chunks up to a per-rank token budget. A request stays on the rank whose KV cache it fills.
"""

from __future__ import annotations

import logging
from collections import deque

from moe_overlap.core.kv_budget import DEFAULT_PAGE_SIZE, pages_for
from moe_overlap.core.step import GroupReply, StepReply
from moe_overlap.engine.finish import FinishRule
from moe_overlap.engine.kv_pages import PageBudget, SlotAllocator
from moe_overlap.engine.load_balance import (
    DEFAULT_LOAD_BALANCE_METHOD,
    GroupLoad,
    check_method,
    choose_group,
)
from moe_overlap.engine.page_keys import may_use, token_ids
from moe_overlap.engine.pdmux import PrefillWaves
from moe_overlap.engine.prefix_cache import PrefixCache
from moe_overlap.engine.prefix_states import PrefixStates
from moe_overlap.engine.request import Request
from moe_overlap.engine.scheduled_step import Step, make_batch
from moe_overlap.engine.speculation import Speculation
from moe_overlap.engine.window_pages import WindowPages

log = logging.getLogger(__name__)


def _states(entries: int | None) -> PrefixStates | None:
    return None if entries is None else PrefixStates(entries)


def _windows(windows: tuple[int, int] | None, page_size: int) -> WindowPages | None:
    return None if windows is None else WindowPages(*windows, page_size)


class Scheduler:
    def __init__(
        self,
        num_ranks: int,
        num_slots: int,
        max_len: int,
        max_num_batched_tokens: int,
        eos_token_id: int | None = None,
        load_balance_method: str = DEFAULT_LOAD_BALANCE_METHOD,
        pdmux: PrefillWaves | None = None,
        num_pages: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        prefix_caching: bool = False,
        speculation: Speculation | None = None,
        state_snapshots: int | None = None,
        windows: tuple[int, int] | None = None,
    ):
        """``num_pages`` of ``page_size`` tokens: each rank's KV pool (None: every slot at
        ``max_len``), which admission counts; ``prefix_caching``: full pages are shared by
        later requests that start with the same tokens (``engine/prefix_cache.py``);
        ``speculation``: decode steps verify drafts; ``state_snapshots``: a hybrid model's
        recurrent-state entries per rank for prefix caching (None: the model has none);
        ``windows``: (window tokens, pages): the sliding-window layers' own pool per rank,
        counted beside the pages (None: it has as many pages, so they never run out first)."""
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        self.max_len = max_len
        self.budget = max_num_batched_tokens
        self.finish = FinishRule(eos_token_id, max_len)
        self.slots = [SlotAllocator(num_slots) for _ in range(num_ranks)]
        pages = num_slots * pages_for(max_len, page_size) if num_pages is None else num_pages
        self.pages = [PageBudget(pages, page_size) for _ in range(num_ranks)]
        mtp = speculation is not None and speculation.config.is_mtp  # keys hold the next token
        self.prefix = [
            PrefixCache(
                b, prefix_caching, _states(state_snapshots), _windows(windows, page_size), mtp
            )
            for b in self.pages
        ]
        self.page_size, self.preemptions = page_size, 0
        self.running: list[list[Request]] = [[] for _ in range(num_ranks)]
        self.waiting: deque[Request] = deque()
        self.method, self.turn = check_method(load_balance_method), 0
        self.pdmux = pdmux  # prompts go whole, in layer ranges, beside the decode steps
        # (rank, request) aborted in a wave, which still writes its pages and reads its hit
        self.deferred: list[tuple[int, Request]] = []
        self.speculation = speculation
        self.ahead = 0 if speculation is None else speculation.writes_ahead  # MTP rows' pages

    def add(self, request: Request) -> None:
        """Queue ``request``; one whose longest run could never fit the pool is refused."""
        need, pool = self._longest(request), self.pages[0]
        if need > pool.total:
            raise ValueError(
                f"request {request.request_id} may reach {self._tokens_of(request)} tokens, "
                f"{need} KV pages of {pool.page_size}, but a rank's pool holds {pool.total}"
            )
        self.waiting.append(request)

    def abort(self, requests: list[Request]) -> None:
        """Forget ``requests`` wherever they are (waiting or running) and free their slots."""
        ids = {req.request_id for req in requests}
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for rank, running in enumerate(self.running):
            for req in [r for r in running if r.request_id in ids]:
                running.remove(req)
                if self.pdmux is not None and self.pdmux.in_wave(req):
                    self.deferred.append((rank, req))  # freed when the wave ends
                else:
                    self._free(rank, req)

    def has_work(self) -> bool:  # ``deferred``: aborted in a PD-mux wave, freed as it ends
        return bool(self.waiting or self.deferred) or any(self.running)

    def schedule(self) -> Step:
        for cache, running in zip(self.prefix, self.running, strict=True):
            for req in running:  # pages computed by the last step become shareable
                cache.publish_computed(req)
        self._admit()
        batches, scheduled, drafts = [], [], []
        for rank in range(len(self.running)):
            seqs = self._plan(rank)
            if self.speculation is None:  # a verify forward's state takes in rejected drafts
                decode = [(r.slot, r.num_computed, len(t)) for r, t in seqs if not r.in_prefill]
                self.prefix[rank].keep_decoded(decode)
            drafts.append(self._draft(rank, seqs))
            scheduled.append([(req, len(tokens)) for req, tokens in seqs])
            batches.append(make_batch(seqs, drafts[-1]))
        waves = self.pdmux
        prefill = waves.next_slice(self.running, make_batch) if waves is not None else None
        if waves is not None and prefill is not None and prefill.last:
            prefill.samples = [
                [r.sample_spec(r.prompt_len) for r in g] for g in waves.members or []
            ]
        pages = [c.take_ops() for c in self.prefix]
        return Step(batches, scheduled, prefill, pages=pages, drafts=drafts)

    def update(self, step: Step, reply: StepReply) -> list[Request]:
        """Take each group's sampled tokens (and a finished prefill wave's); return the
        requests that finished."""
        finished: list[Request] = []
        for rank, (entries, group) in enumerate(zip(step.scheduled, reply.groups, strict=True)):
            self._consume(step, rank, entries, group, finished, step.drafts_of(rank))
            if self.speculation is not None:
                self.speculation.stats.rollbacks += group.rollbacks
        if step.prefill is not None and step.prefill.last:
            assert self.pdmux is not None and reply.wave is not None
            for rank, members in enumerate(self.pdmux.finish()):
                wave = [(r, r.prompt_len - r.num_computed) for r in members]
                self._consume(step, rank, wave, reply.wave[rank], finished)
            for rank, req in self.deferred:
                self._free(rank, req)
            self.deferred = []
        return finished

    def _consume(
        self,
        step: Step,
        rank: int,
        entries: list[tuple[Request, int]],
        reply: GroupReply,
        finished: list[Request],
        drafts: list[list[int]] | None = None,  # per entry, a verify step's
    ) -> None:
        row = 0  # into the logit rows of the sequences that keep theirs
        for i, (req, n) in enumerate(entries):
            keep = req.keeps_logits
            if keep:
                assert reply.logits is not None
                chunk = reply.logits[row : row + n].clone()
                row += n
            if req not in self.running[rank]:  # aborted while its prefill wave ran
                continue
            if keep:
                req.logit_chunks.append(chunk)
            req.prompt_logprobs.extend(reply.prompt_logprobs[i])
            req.num_computed += n
            if req.num_computed < req.total_len:
                continue  # a middle prompt chunk, or a recomputed one: nothing sampled
            step.sampled.append(req)
            token, error = reply.token_ids[i], reply.errors[i]
            if req.params.max_new_tokens == 0:  # the prompt was only scored
                req.finish_reason = "length"
            elif token is None:  # its draw failed on the rank: it ends alone
                req.error, req.finish_reason = error or "no token was sampled", "error"
            else:
                drafted = len(drafts[i]) if drafts else 0
                self.finish.take(req, reply, i, drafted, self.speculation)
            if req.finish_reason:
                self.running[rank].remove(req)
                self._free(rank, req)
                finished.append(req)

    def _admit(self) -> None:
        while self.waiting:
            rank = choose_group(self.method, self.loads(self.waiting[0]), self.turn)
            if rank is None:
                return
            req, cache = self.waiting[0], self.prefix[rank]
            pdmux = self.pdmux is not None
            need = self._longest(req) if pdmux else pages_for(req.total_len, self.page_size)
            chain = cache.lookup(token_ids(req, 0, req.total_len), may_use(req))
            cache.acquire(chain)  # before room is made: these are not evicted for it
            if not cache.make_room(need - len(chain)):
                cache.drop(chain)
                return  # first come, first served: it waits for pages to come back
            self.turn = rank + 1
            self.waiting.popleft()
            req.rank, req.slot, req.pages = rank, self.slots[rank].alloc(), need
            req.cached, req.num_computed = chain, len(chain) * self.page_size
            req.cached_tokens = req.cached_tokens if req.preemptions else req.num_computed
            self.pages[rank].hold(need - len(chain))
            cache.admit(req, chain)
            self.running[rank].append(req)

    def _plan(self, rank: int) -> list[tuple[Request, list[int]]]:
        """This rank's sequences and the tokens each feeds: decode tokens first (cheap, and
        they keep latency low), then prompt chunks within the token budget. Where the pages
        they grow into are not free, the newest running request is preempted by recompute."""
        running, pool = self.running[rank], self.pages[rank]
        while True:
            budget, seqs = self.budget, []
            for req in sorted(running, key=lambda r: r.in_prefill):
                if budget == 0 or (self.pdmux is not None and req.in_prefill):
                    break  # under pdmux prompts go in waves
                tokens = req.next_input(budget)
                seqs.append((req, tokens))
                budget -= len(tokens)
            grow = [self._growth(req, len(tokens)) for req, tokens in seqs]
            if self.prefix[rank].make_room(sum(grow)) and self._take_windows(rank, seqs):
                break
            self._preempt(rank, running[-1])
        for (req, _), pages in zip(seqs, grow, strict=True):
            pool.hold(pages)
            req.pages += pages
        return seqs

    def _take_windows(self, rank: int, seqs: list[tuple[Request, list[int]]]) -> bool:
        """Hold the sliding-window pages ``seqs`` take on ``rank``, where they are free."""
        pool = self.prefix[rank].windows
        return pool is None or pool.take([(r.slot, r.num_computed, len(t)) for r, t in seqs])

    def _draft(self, rank: int, seqs: list[tuple[Request, list[int]]]) -> list[list[int]]:
        if self.speculation is None:
            return [[] for _ in seqs]
        return self.speculation.draft_step(seqs, self.budget, self.max_len, self.pages[rank])

    def _growth(self, req: Request, fed: int) -> int:
        end = min(self.max_len, req.num_computed + fed + self.ahead)
        return max(0, pages_for(end, self.page_size) - req.pages)

    def _preempt(self, rank: int, req: Request) -> None:
        """Free ``req``'s slot and pages and queue it first, to feed its tokens again."""
        self.running[rank].remove(req)
        self._free(rank, req)
        req.preempt()
        self.waiting.appendleft(req)
        self.preemptions += 1
        log.info(
            "preempted request %d (%d tokens) by recompute: rank %d is out of KV pages",
            req.request_id,
            req.total_len,
            rank,
        )

    def _tokens_of(self, req: Request) -> int:
        """The most tokens ``req`` can reach: its prompt and every new token, within max_len."""
        return min(self.max_len, req.prompt_len + req.params.max_new_tokens)

    def _longest(self, req: Request) -> int:
        """The pages of ``req``'s longest run, and of MTP rows past it (a PD-mux wave's)."""
        return pages_for(min(self.max_len, self._tokens_of(req) + self.ahead), self.page_size)

    def _free(self, rank: int, req: Request) -> None:
        """Give back ``req``'s slot and own pages; its computed full pages stay cached."""
        cache = self.prefix[rank]
        cache.publish_computed(req)
        cache.leave(req.slot)  # admitted and preempted in one step: the rank never sees it
        self.slots[rank].release(req.slot)
        self.pages[rank].give(req.slot, req.pages - len(req.cached))
        cache.drop(req.cached)
        req.cached = []

    def loads(self, req: Request | None = None) -> list[GroupLoad]:
        """Each data-parallel group's load, as the balancing policies (the DP controller) read
        it; for ``cache_aware``, with ``req``'s prompt tokens each group has cached. The tokens
        left are summed for ``minimum_tokens`` only, the policy that reads them (0 otherwise):
        a sum over the running requests per admission made admitting a batch quadratic."""
        affinity = req is not None and self.method == "cache_aware"
        counts = self.method == "minimum_tokens"
        return [
            GroupLoad(
                len(running),
                sum(r.prompt_len - r.num_computed + 1 for r in running) if counts else 0,
                len(slots),
                cache.cached_tokens(req, may_use(req)) if affinity and req else 0,
            )
            for running, slots, cache in zip(self.running, self.slots, self.prefix, strict=True)
        ]
