"""CUDA graphs under speculative decoding, everything but the capture: the bucket choice,
padding and staged rows of a target-verify step (pure), the padded, buffer-fed verify forward a
graph holds (``capture=False`` runs it eagerly) against the eager verify, and one engine whose
verify steps and MTP draft steps run through those graphs giving plain greedy decoding's
tokens. The capture itself runs in tests/gpu/test_spec_graphs.py."""

from __future__ import annotations

from dataclasses import replace

import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch, ForwardMode
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.overlap.split import Piece, plan_two_batch, split_batch
from moe_overlap.runtime.graph_buckets import (
    Bucket,
    capture_batch,
    choose_bucket,
    rows_per_seq,
    staged_rows,
)
from moe_overlap.runtime.mtp_drafter import MtpDrafter
from moe_overlap.runtime.rank import build_rank_runner
from tests.helpers import TINY, max_abs_diff
from tests.runtime.test_cuda_graphs import eager_graphs

SIZES = [1, 2, 4, 8]


def verify(slots, prefixes, width, ids=None) -> ForwardBatch:
    n = len(slots)
    ids = torch.arange(n * width) + 1 if ids is None else ids
    return ForwardBatch(ids, slots, prefixes, [width] * n, [True] * n, [True] * n)


def decode(slots, prefixes) -> ForwardBatch:
    n = len(slots)
    return ForwardBatch(torch.arange(n) + 1, slots, prefixes, [1] * n, is_decode=[True] * n)


def test_bucket_choice_padding_and_staged_rows():
    three = verify([0, 2, 5], [3, 40, 300], width=4)
    assert rows_per_seq([three]) == 4
    assert choose_bucket([three], SIZES, 4096) == Bucket(4, 4, 512)
    assert choose_bucket([decode([0, 2, 5], [3, 40, 300])], SIZES, 4096) == Bucket(4, 1, 512)
    # the bucket is offered to the low-latency cap's test, which counts its padded rows
    asked = []
    assert choose_bucket([three], SIZES, 4096, asked.append) is None  # None: does not fit
    assert asked == [Bucket(4, 4, 512)]
    assert choose_bucket([three], SIZES, 4096, lambda b: b.rows <= 16) == Bucket(4, 4, 512)
    idle = ForwardBatch.idle()
    assert choose_bucket([three, idle], SIZES, 4096) == Bucket(4, 4, 512)  # an idle group joins
    assert choose_bucket([idle], SIZES, 4096) is None
    # no one graph: groups of different widths, a prefill, a verify without every row's logits
    assert choose_bucket([three, decode([1], [9])], SIZES, 4096) is None
    assert choose_bucket([ForwardBatch(torch.arange(5), [1], [0], [5])], SIZES, 4096) is None
    partial = ForwardBatch(torch.arange(4), [1, 2], [5, 5], [2, 2], is_decode=[True] * 2)
    assert partial.mode == ForwardMode.TARGET_VERIFY and rows_per_seq([partial]) is None
    assert choose_bucket([verify(list(range(9)), [1] * 9, 2)], SIZES, 4096) is None  # > 8
    # the batch's rows, then a padding sequence's at positions 0 .. 3 of the scratch slot
    two = verify([3, 1], [10, 7], width=3, ids=torch.tensor([5, 6, 7, 8, 9, 10]))
    bucket = choose_bucket([two, three], SIZES, 4096)
    assert bucket is None  # widths 3 and 4
    bucket = choose_bucket([two], [1, 3], 4096)
    assert bucket == Bucket(3, 3, 256)
    staged = staged_rows(two, bucket, scratch=9)
    assert staged.tolist() == [
        [5, 6, 7, 8, 9, 10, 0, 0, 0],
        [10, 11, 12, 7, 8, 9, 0, 1, 2],
        [3, 3, 3, 1, 1, 1, 9, 9, 9],
    ]
    # the capture's batch: a verify batch to every vote and split, its rows in the buffers
    held = capture_batch(bucket, staged, scratch=9)
    assert held.mode == ForwardMode.TARGET_VERIFY and held.token_num_per_seq == 3
    assert held.num_tokens == 9 and max(held.seq_lens) == 256
    # TBO cuts it by whole sequences (SGLang's rule), DBO's token cut may fall inside one:
    # each child reads its contiguous run of the buffers
    first, second = split_batch(held, plan_two_batch(held, threshold=0.0))
    assert first.device_inputs.positions.tolist() == [10, 11, 12]
    assert second.device_inputs.slots.tolist() == [1, 1, 1, 9, 9, 9]
    cut = [[Piece(0, 0, 3), Piece(1, 0, 1)], [Piece(1, 1, 2), Piece(2, 0, 3)]]
    left, right = split_batch(held, cut)
    assert left.device_inputs.input_ids.tolist() == [5, 6, 7, 8]
    assert right.device_inputs.positions.tolist() == [8, 9, 0, 1, 2]


def test_the_padded_buffer_fed_verify_gives_the_eager_logits():
    """A verify step of three sequences, three drafts each, in the graph of four: the same
    logits as the eager verify (an extend) without overlap, with TBO (cut by sequences) and
    with DBO; the padding sequence wrote the scratch slot only."""
    for family in ("qwen3_moe", "deepseek_v3"):
        cfg = ModelConfig(**TINY[family])
        runner = build_rank_runner(EngineSpec(cfg, seed=0, max_num_seqs=7, max_len=300))
        gen = torch.Generator().manual_seed(1)
        slots, lengths = [0, 2, 5], [3, 40, 90]
        runner.forward(
            ForwardBatch(
                torch.randint(cfg.vocab_size, (133,), generator=gen), slots, [0, 0, 0], lengths
            )
        )
        step = verify(slots, lengths, 4, torch.randint(cfg.vocab_size, (12,), generator=gen))
        graphs = eager_graphs(runner, 4)
        for overlap in (
            OverlapConfig("none"),
            OverlapConfig("tbo", tbo_min_tokens=1),
            OverlapConfig("dbo", dbo_decode_token_threshold=1),
        ):
            eager = runner.forward(step, overlap)
            runner.graphs = graphs
            assert graphs.covers([step], overlap, False)
            replayed = runner.forward(step, overlap)
            runner.graphs = None
            assert runner.last_mode == overlap.mode, family
            assert replayed.shape == eager.shape == (12, cfg.vocab_size)
            assert max_abs_diff(replayed, eager) <= 1e-4, (family, overlap.mode)
            assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
        # over the low-latency dispatch the padded rows (4 x 4) must fit its capacity
        low_latency = OverlapConfig("none", a2a_mode="low_latency")
        for cap, fits in ((16, True), (15, False)):
            cfg_cap = replace(low_latency, num_max_dispatch_tokens_per_rank=cap)
            assert graphs.covers([step], cfg_cap, True) == fits
        assert {k[0] for k in graphs.graphs} == {Bucket(4, 4, 256)}
        kv = runner.kv_cache
        assert len(kv.held[graphs.scratch]) == 1  # the padding rows' one page
        assert not set(kv.held[graphs.scratch]) & {p for s in slots for p in kv.held[s]}


MTP_DEEPSEEK = ModelConfig(
    **(TINY["deepseek_v3"] | dict(num_nextn_predict_layers=1, max_position_embeddings=256))
)
PROMPTS = [[3, 4, 5, 6] * 5, [7, 8, 9] * 4 + [1], [2] * 9, [5, 1, 5, 2, 5, 1]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


def graphed_and_eager(llm: LLM) -> dict[str, object]:
    """Plain greedy decoding's tokens, then speculative decoding's eagerly and from the
    runner's graphs (its decode graphs and, with MTP, its drafter's): each run's tokens, its
    verify steps and MTP drafts, and the graph buckets the graphed run met."""
    runner = llm.executor.runner
    graphs, drafter = runner.graphs, runner.mtp
    draft_graphs = drafter.graphs if drafter is not None else None
    drafted: list[list[list[int]]] = []  # every MTP step's drafts, in order
    if drafter is not None:
        draft = drafter.draft
        drafter.draft = lambda *args: drafted.append(draft(*args)) or drafted[-1]
    speculation, llm.scheduler.speculation = llm.scheduler.speculation, None
    runner.graphs = None
    if drafter is not None:
        drafter.graphs = None
    plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.scheduler.speculation = speculation
    drafted.clear()
    before = speculation.stats.verifications
    eager = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    eager_verifies = speculation.stats.verifications - before
    eager_drafts, drafted[:] = list(drafted), []
    runner.graphs = graphs
    if drafter is not None:
        drafter.graphs = draft_graphs
    before = speculation.stats.verifications
    graphed = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return {
        "plain": plain,
        "eager": eager,
        "graphed": graphed,
        "verifies": (eager_verifies, speculation.stats.verifications - before),
        "drafts": (eager_drafts, drafted),
        "buckets": {k[0] for k in graphs.graphs},
        "draft_buckets": set() if draft_graphs is None else set(draft_graphs.graphs),
    }


def test_graphed_speculative_decode_gives_plain_greedy_tokens():
    """One process, one engine per drafter: n-gram drafts (tiny Qwen3-MoE) and DeepSeek-V3's
    MTP drafts (two steps from its one layer), each run plain, speculative eagerly and
    speculative through the graphs' padded, buffer-fed forwards; one slot more than the
    requests use is the padding rows' scratch slot."""
    cases = {
        "ngram": (ModelConfig(**TINY["qwen3_moe"]), dict(speculative_algorithm="NGRAM")),
        "mtp": (MTP_DEEPSEEK, dict(speculative_algorithm="EAGLE", speculative_num_steps=2)),
    }
    for name, (cfg, spec) in cases.items():
        kw = dict(config=cfg, seed=0, max_num_seqs=len(PROMPTS) + 1, enable_prefix_caching=False)
        with LLM(**kw, **spec) as llm:
            runner = llm.executor.runner
            runner.graphs = eager_graphs(runner, 4)
            if runner.mtp is not None:  # a drafter whose steps run as graphs would
                runner.mtp = MtpDrafter(
                    runner.model, runner.kv_cache, 2, graph_max_bs=4, capture=False
                )
            got = graphed_and_eager(llm)
        assert got["eager"] == got["plain"], name
        assert got["graphed"] == got["plain"], name
        assert all(n > 0 for n in got["verifies"]), (name, got["verifies"])
        widths = {b.width for b in got["buckets"]}
        assert max(widths) > 1, (name, got["buckets"])  # verify steps replayed
        assert got["drafts"][0] == got["drafts"][1], name  # the same MTP drafts, step by step
        if name == "mtp":  # the first step padded to the verify's rows, and the second
            assert any(len(d) == 2 for step in got["drafts"][1] for d in step)
            assert {layer for _, layer in got["draft_buckets"]} == {0}
            widths = {b.width for b, _ in got["draft_buckets"]}
            assert 1 in widths and 3 in widths, got["draft_buckets"]
