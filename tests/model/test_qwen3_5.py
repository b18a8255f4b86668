"""Qwen3.5-MoE (hybrid: Gated DeltaNet linear attention beside gated full attention):
transformers' logits and greedy tokens on one process, chunked prefill included; the recurrent
state's order guard; and every overlap mode at ep=2 on real gloo ranks, two-chunk cuts included,
against one process without overlap.

transformers' oracle is its uncached forward: in 5.23 its cached ``generate`` for this model
disagrees with its own uncached forward from the second new token on, so greedy tokens are
checked against argmax of a full forward per step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import state_bytes
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.state_cache import StateOrderError
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.model.linear_attention import GatedDeltaNet
from moe_overlap.model.loader import build_model
from moe_overlap.model.tensor_parallel import Shard
from moe_overlap.overlap.split import plan_two_batch, split_batch
from moe_overlap.runtime.model_runner import ModelRunner
from tests.family_suite import CASES, layout_matches_one_process, made_model_matches_transformers
from tests.helpers import (
    KW,
    PARAMS,
    every_mode,
    force_overlap,
    max_abs_diff,
    qwen3_5_hf_config,
    save_hf_model,
)

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
MODES = every_mode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return path, save_hf_model(qwen3_5_hf_config(), path)


@pytest.mark.parametrize("budget", [None, 24])  # 24: chunked prefill, the state carried over
def test_logits_and_greedy_tokens_match_transformers(checkpoint, budget):
    path, hf = checkpoint
    kw = {} if budget is None else dict(max_num_batched_tokens=budget)
    with LLM(path, **kw) as llm:
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True), True
        )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
            assert max_abs_diff(out.prompt_logits, ref) <= 1e-4, len(prompt)
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
    assert max_abs_diff(runner.forward_plain(whole), expected) == 0.0


def test_layouts_refused_with_the_model_and_flag():
    cfg = ModelConfig(**TINY)
    with pytest.raises(ConfigError, match="--enable-pdmux.*qwen3_5_moe"):
        LLM(config=cfg, enable_pdmux=True)


def test_bench_refuses_decode_workloads_it_would_replay(capsys):
    from moe_overlap.tools.cli import main

    argv = ["bench", "--hf-config", "configs/qwen3_5-moe-tiny.json", "--ep", "2"]
    argv += ["--workload", "decode:4:16"]
    assert main(argv) == 2
    assert "recurrent state cannot replay a step" in capsys.readouterr().err


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


@pytest.mark.parametrize("mode", MODES)
def test_ep2_modes_match_one_process(ep2, mode, monkeypatch):
    llm, base = ep2
    overlap = MODES[mode]
    force_overlap(llm, overlap, monkeypatch)
    for case, prompts in CASES.items():
        got = llm.generate(prompts, PARAMS, return_logits=True)
        for a, b in zip(base[case], got, strict=True):
            assert a.token_ids == b.token_ids, (mode, case)
            assert max_abs_diff(a.prompt_logits, b.prompt_logits) <= 1e-4, (mode, case)
    # and no fallback to one batch: every rank ran each micro-batch
    batch = ForwardBatch(torch.tensor([5] * 13 + [7] * 9), [0, 1], [0, 0], [13, 9], [True] * 2)
    reply = llm.executor.run([batch, batch], overlap, record=True)
    parts = overlap.num_micro_batches if overlap.mode in ("tbo", "dbo") else 1
    for r in range(2):
        tracks = {s.track for s in reply.spans[r]}
        assert {f"mb{i}" for i in range(4)} & tracks == {f"mb{i}" for i in range(parts)}, mode


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
        assert max_abs_diff(plain.logits[r], got.logits[r]) <= 1e-4
        tracks = {s.track for s in got.spans[r]}
        assert {"mb0", "mb1"} <= tracks, tracks


def test_make_model_writes_a_checkpoint_transformers_reads(tmp_path):
    """configs/qwen3_5-moe-tiny.json through ``make-model``: transformers loads what it wrote
    (the Hub's names and config) and computes our logits."""
    made_model_matches_transformers("configs/qwen3_5-moe-tiny.json", tmp_path, 70)


def test_planner_costs_linear_attention_linear_in_context():
    """The planner's attention core for Qwen3.5: only the full-attention layers' share grows
    with the context (here 1 of 4 layers), and the time split's cost model says the same."""
    from moe_overlap.core.model_flops import ModelFlops
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
    assert ModelFlops.for_model(hybrid).per_pair == 0.25 * ModelFlops.for_model(full).per_pair


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, dp=2, enable_dp_attention=True),
        dict(pp=2),
        dict(tp=2, ep=2),
        dict(tp=4, dp=2, ep=4, enable_dp_attention=True),
        dict(tp=4, ep=4),
    ],
    ids=[
        "dp-attention+moe-tp",
        "pp2",
        "attention-tp2",
        "dp-attention+attention-tp2",
        "attention-tp4-replicated",
    ],
)
def test_other_layouts_match_one_process(ep2, layout):
    """DP attention (attention TP 1, experts cut by moe-TP), two pipeline stages (each
    stage's state cache holds its own layers' states; a prompt cut between pipeline
    micro-batches runs its pieces in order on every stage) and attention TP (the reference's
    --tp 8 --ep 8: the linear-attention layers' 2 key and 4 value heads split over 2 ranks,
    and replicated over 4, which they do not divide), under two-chunk TBO."""
    _, base = ep2
    layout_matches_one_process(ModelConfig(**TINY), layout, base["mixed-batch"])


def test_loads_the_hubs_multimodal_layout(tmp_path):
    """The Hub's Qwen3.5 checkpoints nest the language model: ``text_config`` in config.json and
    tensors under ``model.language_model.``; they load as the text model's."""
    import json

    from safetensors.torch import load_file, save_file

    from moe_overlap.model.loader import save_checkpoint

    cfg = ModelConfig(**TINY)
    save_checkpoint(build_model(cfg, seed=3), tmp_path / "flat")
    tensors = load_file(tmp_path / "flat" / "model.safetensors")
    nested = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    (tmp_path / "hub").mkdir()
    save_file(nested, tmp_path / "hub" / "model.safetensors")
    config = {"model_type": "qwen3_5_moe", "text_config": cfg.to_hf(), "vision_config": {}}
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    prompt = [[4, 8, 15, 16, 23, 42] * 5]
    outs = []
    for where in ("flat", "hub"):
        with LLM(tmp_path / where) as llm:
            outs.append(llm.generate(prompt, PARAMS, return_logits=True)[0])
    assert outs[0].token_ids == outs[1].token_ids
    assert max_abs_diff(outs[0].prompt_logits, outs[1].prompt_logits) == 0.0


def test_linear_attention_heads_split_where_they_divide():
    """Each rank of attention TP 2 holds 1 key and 2 value heads: its share of each part of
    the fused projection and the conv (rank 1: the second query, key and value blocks), and a
    state half the size; TP 4, which the heads do not divide, replicates the layer."""
    cfg = ModelConfig(**TINY)
    layer = GatedDeltaNet(cfg, 0, SimpleNamespace(size=2, rank=1))
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim  # 2 key, 4 value heads in all
    assert (layer.k_heads, layer.v_heads) == (1, 2)
    for weight in (layer.in_proj_qkv.weight, layer.conv1d.weight):
        assert weight.shard.parts == ((dk, dk), (3 * dk, dk), (4 * dk + 2 * dv, 2 * dv))
    whole = GatedDeltaNet(cfg, 0, SimpleNamespace(size=4, rank=3))  # replicated: one shard
    assert whole.k_heads == 2 and whole.in_proj_qkv.weight.shard == Shard(0, 0, 4 * dk + 4 * dv)
    assert state_bytes(cfg, 4, 2) * 2 == state_bytes(cfg, 4, 1) == state_bytes(cfg, 4, 4)
