"""MiMo-V2-Flash's MTP layers (``model.mtp.layers.{i}``, ``model/mtp.py``) against a reference
derived here from the checkpoint's definition: transformers 5.24 skips ``model.mtp.*`` on load
and builds no MTP module, so the reference is plain torch for ``eh_proj`` over
``[enorm(embedding); hnorm(hidden)]`` (embedding first), fed transformers' final hidden states,
then transformers' own sliding-window decoder layer with a dense MLP, ``final_layernorm`` and
the model's LM head: a one-layer ``MiMoV2FlashForCausalLM`` whose layer is
``model.mtp.layers.0`` (its ``pre_mlp_layernorm`` the post-attention norm) and whose norm is its
``final_layernorm``, run on those rows as its input embeddings. The window is shorter than the
prompt, so the MTP layer's window and sinks count."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moe_overlap.core.errors import CheckpointError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.loader import build_model
from moe_overlap.tools.cli import main as cli
from tests.engine.test_prefix_exact import one_thread
from tests.helpers import mimo_hf_config
from tests.model.test_mtp import PROMPT, TOL, engine_head, head_reference

transformers = pytest.importorskip("transformers")

EPS = 1e-3  # far from the default: catches a norm taking another eps
MTP = "model.mtp.layers.0."


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _head_checkpoint(path, tensors: dict, out) -> None:
    """A one-layer checkpoint transformers reads: ``model.mtp.layers.0`` as its sliding layer
    with a dense MLP, its ``final_layernorm`` as the final norm, the model's embedding and head."""
    config = json.loads((path / "config.json").read_text())
    config |= dict(
        num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["dense"]
    )
    config.pop("num_nextn_predict_layers")
    layer = {
        "model.layers.0." + k.removeprefix(MTP).replace("pre_mlp_layernorm", "post_attention_layernorm"): v
        for k, v in tensors.items()
        if k.startswith(MTP) and not k.removeprefix(MTP).startswith(("enorm", "hnorm", "eh_proj", "final_"))
    }  # fmt: skip
    rest = {k: tensors[k] for k in ("model.embed_tokens.weight", "lm_head.weight")}
    norm = {"model.norm.weight": tensors[MTP + "final_layernorm.weight"]}
    out.mkdir()
    save_file(layer | rest | norm, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))


def _reference(path, tensors: dict) -> tuple[torch.Tensor, torch.Tensor]:
    def project(embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(
            torch.cat(
                [_rms(embeds, tensors[MTP + "enorm.weight"]),
                 _rms(hidden, tensors[MTP + "hnorm.weight"])], -1
            ),
            tensors[MTP + "eh_proj.weight"],
        )  # fmt: skip

    return head_reference(path, lambda out: _head_checkpoint(path, tensors, out), project)


def test_mimo_mtp_head_matches_the_reference(tmp_path):
    with one_thread():
        _head_matches(tmp_path)


def _head_matches(tmp_path) -> None:
    # a window of 5 keys: the 12-token prompt reaches past it in the target and the MTP layer
    hf = mimo_hf_config(num_nextn_predict_layers=2, rms_norm_eps=EPS, sliding_window=5)
    (tmp_path / "config.json").write_text(json.dumps(hf.to_dict()))
    made = tmp_path / "made"
    cli(["make-model", "--hf-config", str(tmp_path / "config.json"), "--out", str(made)])
    cfg = ModelConfig.from_hf(made)
    assert cfg.num_nextn_predict_layers == 2 and cfg.to_hf()["num_nextn_predict_layers"] == 2
    tensors = load_file(made / "model.safetensors")
    names = ("final_layernorm.weight", "pre_mlp_layernorm.weight", "eh_proj.weight")
    names += ("self_attn.attention_sink_bias",)
    assert all(f"model.mtp.layers.1.{n}" in tensors for n in names)
    assert not any(k.startswith("model.layers.3") for k in tensors)  # under model.mtp.* only
    assert tensors[MTP + "mlp.gate_proj.weight"].shape[0] == cfg.intermediate_size  # dense
    want_hidden, want_logits = _reference(made, tensors)

    runner, hidden, logits = engine_head(cfg, made, PROMPT)
    assert (hidden - want_hidden).abs().max() < TOL
    assert (logits - want_logits).abs().max() < TOL

    model = runner.model
    first, second = model.mtp_layers  # each layer its own, but the LM head is the model's
    assert first.shared_head.head is model.lm_head and second.shared_head.head is model.lm_head
    assert second.eh_proj is not first.eh_proj
    # a checkpoint without the MTP weights: served plainly, refused by name for MTP drafts
    plain = {k: v for k, v in tensors.items() if not k.startswith("model.mtp.")}
    save_file(plain, str(made / "model.safetensors"), metadata={"format": "pt"})
    assert not build_model(cfg, made).mtp_layers
    with pytest.raises(CheckpointError, match="lacks the MTP weights .* NGRAM"):
        build_model(cfg, made, mtp=True)
