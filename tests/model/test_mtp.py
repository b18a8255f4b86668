"""DeepSeek-V3's MTP layer (``model/mtp.py``) against a reference written here from the
checkpoint's definition: transformers 5.24 reads ``num_nextn_predict_layers`` but builds no MTP
module, so the reference is plain torch for ``enorm``, ``hnorm``, ``eh_proj`` and the shared head
around transformers' own ``DeepseekV3DecoderLayer`` (loaded from the checkpoint's
``model.layers.{num_hidden_layers}.*``), fed transformers' final hidden states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moe_overlap import LLM, SamplingParams
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.engine.finish import FinishRule
from moe_overlap.model.loader import build_model, save_checkpoint
from moe_overlap.runtime.rank import build_rank_runner
from tests.helpers import deepseek_hf_config

transformers = pytest.importorskip("transformers")

TOL = 1e-4
LAYERS = 3  # the MTP layer is model.layers.3
PROMPT = [5, 17, 3, 40, 22, 9, 31, 12, 7, 60, 2, 44]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(path, tensors: dict, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final hidden states of PROMPT, and the MTP logits of rows 0..T-2 (row q:
    hidden state q and the embedding of token q + 1), from the published formula."""
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, num_hidden_layers=LAYERS + 1
    ).eval()  # its last layer is the MTP layer's decoder block, read from the checkpoint
    ids = torch.tensor([PROMPT])
    p = f"model.layers.{LAYERS}."

    def block(layer: int, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        rope = model.model.rotary_emb(x, positions)
        y = model.model.layers[layer](
            x, attention_mask=mask, position_ids=positions, position_embeddings=rope
        )
        return y[0] if isinstance(y, tuple) else y

    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        for layer in range(LAYERS):
            x = block(layer, x)
        hidden = model.model.norm(x)  # the target's final hidden states
        embeds = model.model.embed_tokens(ids[:, 1:])
        x = F.linear(
            torch.cat(
                [_rms(embeds, tensors[p + "enorm.weight"], eps),
                 _rms(hidden[:, :-1], tensors[p + "hnorm.weight"], eps)], -1
            ),
            tensors[p + "eh_proj.weight"],
        )  # fmt: skip
        normed = _rms(block(LAYERS, x), tensors[p + "shared_head.norm.weight"], eps)
        logits = F.linear(normed, tensors[p + "shared_head.head.weight"])
    return hidden[0], logits[0]


def test_mtp_head_matches_the_reference_and_loads_without_its_own_head(tmp_path, monkeypatch):
    eps = 1e-3  # far from the default: catches a norm taking another eps
    hf = deepseek_hf_config(num_nextn_predict_layers=1, rms_norm_eps=eps, num_hidden_layers=LAYERS)
    cfg = ModelConfig.from_hf(hf.to_dict())
    save_checkpoint(build_model(cfg, seed=3, mtp=True), tmp_path)  # what make-model writes
    tensors = load_file(tmp_path / "model.safetensors")
    assert f"model.layers.{LAYERS}.eh_proj.weight" in tensors
    want_hidden, want_logits = _reference(tmp_path, tensors, eps)

    runner, hidden, logits = engine_head(cfg, tmp_path, PROMPT)
    assert torch.allclose(hidden, want_hidden, atol=TOL, rtol=0)
    assert (logits - want_logits).abs().max() < TOL

    _engine_drafts_follow_the_head(tmp_path, runner, monkeypatch)

    # a checkpoint without shared_head.head: the MTP layer reads the LM head's
    del tensors[f"model.layers.{LAYERS}.shared_head.head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = build_model(cfg, tmp_path, mtp=True)
    assert torch.equal(model.mtp_layers[0].shared_head.head.weight, model.lm_head.weight)
    assert not build_model(cfg, tmp_path).mtp_layers  # built without them, as plain serving is


def engine_head(cfg: ModelConfig, path, prompt: list[int]):
    """One rank built from the checkpoint at ``path`` with one MTP step: ``prompt``'s prefill,
    then the MTP head over its tokens after the first and the target's hidden states before
    the last. Returns the runner, those hidden states and the head's logits."""
    runner = build_rank_runner(EngineSpec(cfg, str(path), max_num_seqs=1, max_len=64, mtp_steps=1))
    ids = torch.tensor(prompt)
    runner.forward(ForwardBatch(ids, [0], [0], [len(prompt)], [False], [False]))
    hidden = runner.last_hidden
    assert hidden is not None
    drafter = runner.mtp
    assert drafter is not None
    rows = ForwardBatch(ids[1:], [0], [0], [len(prompt) - 1], [True], [False])
    out = drafter.forward(0, rows, hidden[:-1], runner.dispatcher, runner.timeline)
    return runner, hidden, out["logits"]


def head_reference(path, make_head, project) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final hidden states of PROMPT from the checkpoint at ``path``, and the MTP
    logits of rows 0..T-2 (row q: hidden state q and the embedding of token q + 1), for a
    family whose MTP layer transformers does not build: ``make_head(out)`` writes a one-layer
    checkpoint of that layer that transformers reads, and ``project(embeds, hidden)`` gives the
    rows it takes as input embeddings."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # skips the MTP
    make_head(path / "head")
    head = transformers.AutoModelForCausalLM.from_pretrained(path / "head").eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state  # normed
        embeds = model.model.embed_tokens(ids[:, 1:])
        logits = head(inputs_embeds=project(embeds, hidden[:, :-1])).logits
    return hidden[0], logits[0]


def _engine_drafts_follow_the_head(path, runner, monkeypatch) -> None:
    """The engine's first draft after every step (prefill, decode and verify steps, rejected
    drafts among them) is the MTP head's argmax over a whole recompute of the sequence so far:
    its rows, hidden states and KV entries are the ones the head would see."""
    seen: dict[int, list[tuple[int, list[int]]]] = {}
    take = FinishRule.take

    def record(self, req, reply, i, drafts, speculation=None):
        take(self, req, reply, i, drafts, speculation)
        seen.setdefault(req.request_id, []).append((req.total_len, list(req.mtp_drafts)))

    monkeypatch.setattr(FinishRule, "take", record)
    prompts = [PROMPT[:1], PROMPT, PROMPT[3:9] * 3]
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    with LLM(str(path), speculative_algorithm="EAGLE", speculative_num_steps=2) as llm:
        outs = llm.generate(prompts, greedy)
    checked = 0
    for out in outs:
        tokens = torch.tensor(out.prompt_ids + out.token_ids)
        n = len(tokens)
        runner.forward(ForwardBatch(tokens, [0], [0], [n], [False], [False]))
        rows = ForwardBatch(tokens[1:], [0], [0], [n - 1], [True], [False])
        hidden = runner.last_hidden[:-1]
        logits = runner.mtp.forward(0, rows, hidden, runner.dispatcher, runner.timeline)["logits"]
        head = logits.argmax(-1).tolist()  # row q drafts token q + 2
        for length, drafts in seen[out.request_id]:
            if drafts and length - 2 < len(head):
                assert drafts[0] == head[length - 2], (out.request_id, length)
                checked += 1
    assert checked > 10
