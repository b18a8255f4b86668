"""Qwen3.5-MoE (hybrid: Gated DeltaNet linear attention beside gated full attention):
transformers' logits and greedy tokens on one process, chunked prefill included; the recurrent
state's order guard; and every overlap mode at ep=2 on real gloo ranks, two-chunk cuts included,
against one process without overlap.

transformers' oracle is its uncached forward: in 5.23 its cached ``generate`` for this model
disagrees with its own uncached forward from the second new token on, so greedy tokens are
checked against argmax of a full forward per step.
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.state_cache import StateOrderError
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.model.loader import build_model
from moe_overlap.overlap.split import plan_two_batch, split_batch
from moe_overlap.runtime.model_runner import ModelRunner
from moe_overlap.tools.bench import mode_config
from tests.helpers import qwen3_5_hf_config, save_hf_model

pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 3) % 96 for i in range(n)] for n in (1, 37, 600)]
TINY = dict(
    model_type="qwen3_5_moe",
    vocab_size=80,
    hidden_size=32,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    partial_rotary_factor=0.5,
    intermediate_size=16,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,  # 8-wide heads' gated norm amplifies float noise past 1e-4
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=256,
)
CASES = {
    "mixed-batch": [[9] * 12, [1, 2], list(range(30, 70)), [70, 71, 72], [5]],
    "single-long": [[(7 * i) % 80 for i in range(45)]],
}
MODES = ["tbo", "tbo+two-chunk", "tbo+time-split", "tbo3+time-split", "sbo", "dbo"]
KW = dict(seed=0, max_num_batched_tokens=24)  # chunked prefill and MIXED steps
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return path, save_hf_model(qwen3_5_hf_config(), path)


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("budget", [None, 24])  # 24: chunked prefill, the state carried over
def test_logits_and_greedy_tokens_match_transformers(checkpoint, budget):
    path, hf = checkpoint
    kw = {} if budget is None else dict(max_num_batched_tokens=budget)
    with LLM(path, **kw) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True), True)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
            assert _close(out.prompt_logits, ref) <= 1e-4, len(prompt)
            for _ in range(4):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt) :], len(prompt)


def _runner(cfg: ModelConfig) -> ModelRunner:
    return ModelRunner(
        build_model(cfg, seed=0), LocalDispatcher(cfg.num_experts), num_slots=4, max_len=256
    )


def test_a_later_piece_needs_the_earlier_pieces_state():
    runner = _runner(ModelConfig(**TINY))
    ids = torch.arange(1, 31)
    whole = ForwardBatch(ids, [0], [0], [30], [True])
    first, second = split_batch(whole, plan_two_batch(whole, threshold=0.48))
    with pytest.raises(StateOrderError, match="needs the state after 15 tokens"):
        runner.forward_plain(second)  # the first piece has not run: refused, not wrong
    expected = runner.forward_plain(whole)
    torch.testing.assert_close(
        torch.cat([runner.forward_plain(first), runner.forward_plain(second)]),
        expected,
        rtol=0,
        atol=1e-4,
    )
    # a new sequence in a used slot starts from zeros, whatever the slot held
    assert _close(runner.forward_plain(whole), expected) == 0.0


def test_layouts_refused_with_the_model_and_flag():
    cfg = ModelConfig(**TINY)
    with pytest.raises(ConfigError, match="qwen3_5_moe.*attention TP size 2 \\(--tp 2"):
        LLM(config=cfg, tp=2)
    with pytest.raises(ConfigError, match="--enable-pdmux.*qwen3_5_moe"):
        LLM(config=cfg, enable_pdmux=True)


def test_config_reads_the_hubs_nested_text_config():
    text = ModelConfig(**TINY).to_hf()
    nested = {"model_type": "qwen3_5_moe", "text_config": text}
    assert ModelConfig.from_hf(nested) == ModelConfig(**TINY)


@pytest.fixture(scope="module")
def ep2():
    """An ep=2 engine (one spawn for every mode) and the one-process outputs without overlap."""
    cfg = ModelConfig(**TINY)
    with LLM(config=cfg, **KW) as one:
        base = {c: one.generate(p, PARAMS, return_logits=True) for c, p in CASES.items()}
    with LLM(config=cfg, ep=2, **KW) as llm:
        yield llm, base


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_ep2_modes_match_one_process(ep2, mode, monkeypatch):
    llm, base = ep2
    step, overlap = llm.executor.run, mode_config(mode)
    monkeypatch.setattr(
        llm.executor,
        "run",
        lambda batches, _=None, record=False, prefill=None: step(batches, overlap, record, prefill),
    )
    for case, prompts in CASES.items():
        got = llm.generate(prompts, PARAMS, return_logits=True)
        for a, b in zip(base[case], got, strict=True):
            assert a.token_ids == b.token_ids, (mode, case)
            assert _close(a.prompt_logits, b.prompt_logits) <= 1e-4, (mode, case)


def test_ep2_two_chunk_cuts_the_sequence_and_stays_exact(ep2):
    """One long prompt per rank: two-chunk puts tokens of it in both micro-batches."""
    llm, _ = ep2
    ids = torch.tensor([(5 * i + 2) % 80 for i in range(40)])
    batch = ForwardBatch(ids, [3], [0], [40], [True])
    children = split_batch(batch, plan_two_batch(batch, threshold=0.48))
    assert [c.slots for c in children] == [[3], [3]]  # the same sequence in both
    assert [c.prefix_lens for c in children] == [[0], [20]]
    plain = llm.executor.run([batch, batch], mode_config("none"))
    got = llm.executor.run([batch, batch], mode_config("tbo+two-chunk"), record=True)
    for r in range(2):
        assert _close(plain[r], got[r]) <= 1e-4
        tracks = {s.track for s in llm.executor.last_spans[r]}
        assert {"mb0", "mb1"} <= tracks, tracks


def test_make_model_writes_a_checkpoint_transformers_reads(tmp_path):
    """configs/qwen3_5-moe-tiny.json through ``make-model``: transformers loads what it wrote
    (the Hub's names and config) and computes our logits."""
    from transformers import AutoModelForCausalLM

    from moe_overlap.tools.cli import main

    assert (
        main(["make-model", "--config", "configs/qwen3_5-moe-tiny.json", "--out", str(tmp_path)])
        == 0
    )
    prompt = [(11 * i + 5) % 512 for i in range(70)]
    with LLM(tmp_path) as llm:
        ours = llm.generate([prompt], SamplingParams(max_new_tokens=1), return_logits=True)[0]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert _close(ours.prompt_logits, ref) <= 1e-4


def test_planner_costs_linear_attention_linear_in_context():
    """The planner's attention core for Qwen3.5: only the full-attention layers' share grows
    with the context (here 1 of 4 layers), and the time split's cost model says the same."""
    from moe_overlap.overlap.split import CostModel as SplitCost
    from moe_overlap.planner.cluster import load_cluster, presets
    from moe_overlap.planner.costs import CostModel, Work
    from moe_overlap.planner.inputs import ModelSpec, PlanLayout

    hybrid = ModelConfig.from_hf("configs/qwen3_5-moe-tiny.json")
    full = ModelConfig.from_hf(
        hybrid.to_hf() | {"layer_types": ["full_attention"] * hybrid.num_hidden_layers}
    )

    def growth(cfg: ModelConfig) -> float:
        costs = CostModel(
            ModelSpec(cfg, "q", False), load_cluster(presets()[0]), PlanLayout(1, 1, 1)
        )

        def core(context: int) -> float:
            work = Work(64, 64.0, 64, 0, 64, 64.0 * context, 64 * context)
            return costs.op_seconds(work, 128.0)["attn_core"]

        return core(65536) - core(1024)

    assert 0 < growth(hybrid) < 0.3 * growth(full)
    assert SplitCost.for_model(hybrid).per_pair == 0.25 * SplitCost.for_model(full).per_pair
