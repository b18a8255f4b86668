"""DeepSeek-V3/V2 (MLA, grouped sigmoid/softmax routers, shared experts) match transformers.

Each case builds a random tiny Hugging Face model, randomises every parameter and buffer (HF's
init leaves the router bias at zero, which would hide bugs in the router), saves it, loads it
with ``build_model`` and compares logits: one prompt, a batch, chunked prefill and decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.model.loader import build_model
from moe_overlap.runtime.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")

TOL = 1e-4
VOCAB = 64
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=6,
)
CASES = {
    # rms_norm_eps far from 1e-6: catches q_a/kv_a_layernorm taking the config's eps
    "v3": (
        "V3",
        dict(q_lora_rank=16, n_shared_experts=1, routed_scaling_factor=2.5, rms_norm_eps=1e-3),
    ),
    # DeepSeek-V3's checkpoints stretch RoPE with YaRN: the frequencies, cos/sin times mscale's
    # factor over mscale_all_dim's, and MLA's softmax scale times mscale_all_dim's, squared
    # (unequal here, so both show; V3's own are 1.0 and 1.0)
    "v3_yarn": (
        "V3",
        dict(
            q_lora_rank=16,
            n_shared_experts=1,
            max_position_embeddings=64,
            rope_scaling=dict(
                type="yarn",
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=0.707,
            ),
        ),
    ),
    "v3_no_q_lora_no_interleave": (
        "V3",
        dict(q_lora_rank=None, n_shared_experts=2, rope_interleave=False, norm_topk_prob=False),
    ),
    # norm_topk_prob=True: transformers' V2 router ignores it. With max-per-group scores the
    # group limit can only matter when top_k > topk_group.
    "v2_lite_group_limited": (
        "V2",
        dict(
            q_lora_rank=None,
            n_shared_experts=2,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.7,
            norm_topk_prob=True,
        ),
    ),
    "v2_greedy": (
        "V2",
        dict(q_lora_rank=16, n_shared_experts=1, topk_method="greedy", routed_scaling_factor=1.3),
    ),
}


@dataclass
class Pair:
    hf: torch.nn.Module
    cfg: ModelConfig
    ours: torch.nn.Module

    def runner(self) -> ModelRunner:
        return ModelRunner(
            self.ours, LocalDispatcher(self.cfg.num_experts), num_slots=4, max_len=64
        )

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(ids[None]).logits[0]


def _randomise(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                p.normal_(std=0.1)  # sigmoid scores live in (0, 1): 0.1 changes choices
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # norm weights
            elif name.endswith("gate.weight"):
                p.normal_(std=0.5)  # sharp, token-dependent routing
            else:
                p.normal_(std=0.2)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory) -> Pair:
    version, overrides = CASES[request.param]
    config_cls = getattr(transformers, f"Deepseek{version}Config")
    model_cls = getattr(transformers, f"Deepseek{version}ForCausalLM")
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**_TINY, **overrides})).eval()
    _randomise(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    cfg = ModelConfig.from_hf(path)
    return Pair(hf, cfg, build_model(cfg, path))


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g} > {TOL}"


def test_single_prompt(pair: Pair) -> None:
    ids = _prompt(11, seed=1)
    got = pair.runner().forward(ForwardBatch(ids, [0], [0], [11], all_logits=[True]))
    _assert_close(got, pair.reference(ids))


def test_batch_of_prompts_in_different_slots(pair: Pair) -> None:
    prompts = [_prompt(n, seed=10 + n) for n in (7, 13, 1, 4)]
    lens = [p.numel() for p in prompts]
    batch = ForwardBatch(
        torch.cat(prompts),
        slots=[2, 0, 3, 1],
        prefix_lens=[0] * 4,
        extend_lens=lens,
        all_logits=[True, True, True, False],
    )
    got = pair.runner().forward(batch)
    refs = [pair.reference(p) for p in prompts]
    _assert_close(got, torch.cat([refs[0], refs[1], refs[2], refs[3][-1:]]))


def test_chunked_prefill_equals_single_prefill(pair: Pair) -> None:
    ids = _prompt(14, seed=2)
    whole = pair.runner().forward(ForwardBatch(ids, [1], [0], [14], all_logits=[True]))
    runner, start, chunks = pair.runner(), 0, []
    for n in (5, 6, 3):  # each later chunk attends over the latents the earlier ones cached
        chunks.append(
            runner.forward(
                ForwardBatch(ids[start : start + n], [1], [start], [n], all_logits=[True])
            )
        )
        start += n
    _assert_close(torch.cat(chunks), whole)
    _assert_close(torch.cat(chunks), pair.reference(ids))


def test_decode_loop_equals_full_prefill(pair: Pair) -> None:
    a, b = _prompt(12, seed=3), _prompt(9, seed=4)
    runner = pair.runner()
    runner.forward(ForwardBatch(torch.cat([a[:5], b[:3]]), [0, 2], [0, 0], [5, 3]))
    steps = []
    for i in range(6):  # two sequences of different lengths decode together
        ids = torch.stack([a[5 + i], b[3 + i]])
        steps.append(
            runner.forward(
                ForwardBatch(ids, [0, 2], [5 + i, 3 + i], [1, 1], is_decode=[True, True])
            )
        )
    got = torch.stack(steps)  # [step, seq, vocab]
    _assert_close(got[:, 0], pair.reference(a)[5:11])
    _assert_close(got[:, 1], pair.reference(b)[3:9])


def test_idle_batch_gives_no_logits(pair: Pair) -> None:
    assert pair.runner().forward(ForwardBatch.idle()).shape == (0, VOCAB)


def test_routing_is_really_exercised(pair: Pair) -> None:
    """Tokens pick different experts and groups; the bias and the group limit change choices."""
    cfg, seen = pair.cfg, []
    gates = [layer.mlp.gate for layer in pair.hf.model.layers[cfg.first_k_dense_replace :]]
    hooks = [
        g.register_forward_hook(lambda _m, args, out: seen.append((args[0], *out))) for g in gates
    ]
    try:
        pair.reference(_prompt(24, seed=5))
    finally:
        for h in hooks:
            h.remove()
    per_group = cfg.num_experts // cfg.n_group
    for gate, (x, logits, weights, ids) in zip(gates, seen, strict=True):
        assert len({tuple(sorted(row)) for row in ids.tolist()}) > 3
        assert len({tuple(sorted({e // per_group for e in row})) for row in ids.tolist()}) > 1
        if cfg.model_type == "deepseek_v3":
            sums = weights.sum(-1)
            if cfg.norm_topk_prob:
                torch.testing.assert_close(sums, torch.full_like(sums, cfg.routed_scaling_factor))
            with torch.no_grad():
                bias = gate.e_score_correction_bias.clone()
                gate.e_score_correction_bias.zero_()
                unbiased = gate(x)[2]
                gate.e_score_correction_bias.copy_(bias)
            assert _differs(unbiased, ids), "the bias never changed a choice"
        if cfg.topk_method != "greedy":
            scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
            if cfg.topk_method == "noaux_tc":
                scores = scores + gate.e_score_correction_bias
            plain = scores.topk(cfg.num_experts_per_tok).indices
            assert _differs(plain, ids), "the group limit never changed a choice"


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.sort(-1).values != b.sort(-1).values).any())
