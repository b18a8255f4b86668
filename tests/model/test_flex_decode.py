"""``--attention-backend flex_attention``: decode attention over the page pool in place gives
what the gather-then-SDPA path gives, for pages out of order, a shared prefix page, a partly
written last page and grouped queries; and the engine's greedy tokens and log-probabilities
equal the default backend's one-process ones on real gloo ranks (ep=2) without overlap and
under TBO and DBO, with the prefix cache serving the second wave. (CPU runs FlexAttention unfused: these check
exactness; on a GPU it is compiled.)"""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.attention_plan import AttentionPlan
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.step import PageOps
from moe_overlap.engine.layout_checks import _check_attention_backend
from moe_overlap.model.flex_decode import paged_decode
from moe_overlap.model.layers import decode_attention
from tests.helpers import every_mode, force_overlap

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 16, 4


def filled_cache(lens: list[int]) -> KVCache:
    """Slots 0..n-1 with ``lens`` random keys each; slot 1 shares slot 0's first page, as a
    prefix cache hit attaches it."""
    cache = KVCache(1, len(lens), 64, {"k": (KV_HEADS, DIM), "v": (KV_HEADS, DIM)}, page_size=PAGE)
    cache.reserve([0], [lens[0]])
    cache.apply(PageOps(publish=[(0, 0, 7)], attach=[(1, [7])]))  # a prefix cache hit
    cache.reserve(range(len(lens)), lens)
    assert cache.block_table[1, 0] == cache.block_table[0, 0]
    gen = torch.Generator().manual_seed(0)
    for slot, n in enumerate(lens):
        start = PAGE if slot == 1 else 0  # the shared page is slot 0's to write
        rows = n - start
        entries = {name: torch.randn(rows, KV_HEADS, DIM, generator=gen) for name in ("k", "v")}
        cache.store(0, torch.full((rows,), slot), torch.arange(start, n), **entries)
    return cache


@pytest.mark.parametrize("all_full", [False, True])
def test_reading_pages_in_place_equals_gathering_them(all_full):
    lens = [12, 12, 12] if all_full else [6, 13, 1]
    cache = filled_cache(lens)
    slots = torch.tensor([2, 0, 1])
    keys = max(lens)
    decode_lens = None if all_full else torch.tensor(lens)[slots]
    plan = AttentionPlan(slots, torch.arange(3), slots, decode_lens, keys, 1, [], True)
    q = torch.randn(3, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    ours = paged_decode(q, cache, 0, plan, 0.25)
    k, v = (cache.gather(0, name, slots, keys) for name in ("k", "v"))
    theirs = decode_attention(q, k, v, plan.decode_mask(keys), 0.25)
    assert plan.decode_block_mask is not None  # built once, for every layer
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


PREFIX = [(7 * i + 3) % 80 for i in range(21)]
WAVES = [[PREFIX + [(9 * w + i) % 80] for i in range(3)] for w in range(2)]
GREEDY = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=0)
KW = dict(config=ModelConfig.from_hf("configs/qwen3-moe-tiny.json"), seed=0, page_size=4)
KW |= dict(max_model_len=64)


def both_waves(llm: LLM) -> list:
    for cache in llm.scheduler.prefix:
        cache.flush()
    return [out for wave in WAVES for out in llm.generate(wave, GREEDY)]


def assert_same(base: list, got: list) -> None:
    for a, b in zip(base, got, strict=True):
        assert a.token_ids == b.token_ids
        diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)]
        assert max(diffs) <= 1e-4


def test_the_engine_reads_pages_in_place_as_exactly_at_ep2_in_every_scheme():
    with LLM(**KW) as llm:
        base = both_waves(llm)
    with LLM(**KW, ep=2, attention_backend="flex_attention", max_total_tokens=256) as llm:
        for mode in ("none", "tbo", "dbo"):
            force_overlap(llm, every_mode()[mode])
            assert_same(base, both_waves(llm))
        assert sum(c.hits for c in llm.scheduler.prefix) > 0  # wave 2 read cached pages


def test_an_unknown_backend_and_a_gpu_page_flex_cannot_tile_are_refused():
    with pytest.raises(ConfigError, match="--page-size=8 must be a multiple of 16"):
        _check_attention_backend("flex_attention", 8, "cuda")
    _check_attention_backend("flex_attention", 8, "cpu")  # the CPU reference takes any page
    with pytest.raises(
        ConfigError,
        match="--attention-backend=.flashinfer. must be one of torch_native, flex_attention",
    ):
        LLM(**KW, attention_backend="flashinfer")
