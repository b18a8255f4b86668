"""Qwen3.5's MTP layer (``mtp.*``, ``model/mtp.py``) against a reference derived here from the
checkpoint's definition: transformers 5.24 skips ``mtp.*`` on load and builds no MTP module, so
the reference is plain torch for ``mtp.fc`` over ``[pre_fc_norm_embedding(embedding);
pre_fc_norm_hidden(hidden)]`` (zero-centred norms, embedding first), fed transformers' final
hidden states, and then transformers' own full-attention decoder layer, final norm and LM head:
a one-layer ``Qwen3_5MoeForCausalLM`` whose layer is ``mtp.layers.0``, whose norm is
``mtp.norm`` and whose head is the model's, run on those rows as its input embeddings."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.loader import build_model, save_checkpoint
from moe_overlap.tools.cli import main as cli
from tests.engine.test_prefix_exact import one_thread
from tests.helpers import qwen3_5_hf_config
from tests.model.test_mtp import PROMPT, TOL, engine_head, head_reference

transformers = pytest.importorskip("transformers")


def _centred_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _head_checkpoint(path, tensors: dict, out) -> None:
    """A one-layer checkpoint transformers reads: ``mtp.layers.0`` as its layer, ``mtp.norm``
    as its final norm, the model's embedding and LM head."""
    config = json.loads((path / "config.json").read_text())
    config |= dict(num_hidden_layers=1, layer_types=["full_attention"])
    config.pop("mtp_num_hidden_layers")
    layer = {
        "model.layers.0." + k.removeprefix("mtp.layers.0."): v
        for k, v in tensors.items()
        if k.startswith("mtp.layers.0.")
    }
    rest = {k: tensors[k] for k in ("model.embed_tokens.weight", "lm_head.weight")}
    out.mkdir()
    norm = {"model.norm.weight": tensors["mtp.norm.weight"]}
    save_file(layer | rest | norm, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))


def _reference(path, tensors: dict, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    def project(embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(
            torch.cat(
                [_centred_rms(embeds, tensors["mtp.pre_fc_norm_embedding.weight"], eps),
                 _centred_rms(hidden, tensors["mtp.pre_fc_norm_hidden.weight"], eps)], -1
            ),
            tensors["mtp.fc.weight"],
        )  # fmt: skip

    return head_reference(path, lambda out: _head_checkpoint(path, tensors, out), project)


def test_qwen3_5_mtp_head_matches_the_reference(tmp_path):
    with one_thread():
        _head_matches(tmp_path)


def _head_matches(tmp_path) -> None:
    eps = 1e-3  # far from the default: catches a norm taking another eps
    hf = qwen3_5_hf_config(mtp_num_hidden_layers=1, rms_norm_eps=eps)
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert cfg.num_nextn_predict_layers == 1 and cfg.to_hf()["mtp_num_hidden_layers"] == 1
    save_checkpoint(build_model(cfg, seed=3, mtp=True), tmp_path)  # what make-model writes
    tensors = load_file(tmp_path / "model.safetensors")
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(
        tensors
    )
    assert not any(k.startswith("model.layers.4") for k in tensors)  # under mtp.* only
    want_hidden, want_logits = _reference(tmp_path, tensors, eps)

    _, hidden, logits = engine_head(cfg, tmp_path, PROMPT)
    assert (hidden - want_hidden).abs().max() < TOL
    assert (logits - want_logits).abs().max() < TOL
    assert not build_model(cfg, tmp_path).mtp_layers  # built without them, as plain serving is


def test_make_model_writes_qwen3_5_mtp_layers(tmp_path):
    config = tmp_path / "config.json"
    hf = qwen3_5_hf_config(mtp_num_hidden_layers=2).to_dict()
    config.write_text(json.dumps(hf))
    cli(["make-model", "--hf-config", str(config), "--out", str(tmp_path / "made")])
    tensors = load_file(tmp_path / "made" / "model.safetensors")
    assert {"mtp.layers.1.input_layernorm.weight", "mtp.pre_fc_norm_hidden.weight"} <= set(tensors)
    model = build_model(ModelConfig.from_hf(tmp_path / "made"), tmp_path / "made", mtp=True)
    first, second = model.mtp_layers  # one projection, norms and head for both layers
    assert second.eh_proj is first.eh_proj and second.shared_head.head is model.lm_head
