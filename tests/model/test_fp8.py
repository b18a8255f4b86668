"""FP8 checkpoints (``make-model --quantize fp8``, 32x32 blocks on the tiny configs, 16x16 on the
helpers' GLM-4.5 and MiMo-V2-Flash configs, whose dimensions are smaller): one process against
transformers on the same FP8 weights; ``--fp8-dequant-on-the-fly`` bit for bit the
default; every overlap mode at ep=2 and TP 2 (its shards cutting blocks) against one process;
named errors for bad checkpoints.

transformers' reference: its ``from_pretrained`` FP8 loader needs ``accelerate`` (not in this
environment), so the test dequantizes a copy and transformers loads that. For Qwen3-MoE and
Qwen3.5-MoE the copy is dequantized by transformers' own ``Fp8Dequantize``; for DeepSeek-V3 that
op gets the non-dividing grid of ``kv_a_proj_with_mqa`` wrong (40 rows in 2 blocks of 32, the
last short; it raises where the grid does not divide the rows, as DeepSeek-V3's 576 rows in 5
blocks of 128), which the test checks, so the test dequantizes that copy itself.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_overlap import LLM, SamplingParams
from moe_overlap.core.errors import CheckpointError, ConfigError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model import loader
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.checkpoint_layout import Entry
from moe_overlap.model.fp8_checkpoint import quantize_checkpoint
from moe_overlap.model.fp8_resident import column_block, fp8_path, keep_resident
from moe_overlap.model.fp8_scale_layout import gemm_works, pad_grid, quantize_activations
from moe_overlap.model.fp8_w8a8 import W8A8Linear
from moe_overlap.model.fp8_weights import dequantize, resident_bytes
from moe_overlap.model.loader import build_model, load_checkpoint, save_checkpoint
from moe_overlap.model.quant_config import quant_config_of
from moe_overlap.model.tensor_parallel import Shard
from moe_overlap.tools.cli import main
from tests.helpers import every_mode, force_overlap, glm4_hf_config, max_abs_diff, mimo_hf_config

transformers = pytest.importorskip("transformers")

CONFIGS = {  # blocks of 32: kv_a_proj_with_mqa's 40 rows are 2 blocks, the last short
    "qwen3_moe": "configs/qwen3-moe-tiny.json",
    "deepseek_v3": "configs/deepseek-v3-tiny.json",
    "qwen3_5_moe": "configs/qwen3_5-moe-tiny.json",
}
HF_CONFIGS = {  # blocks of 16: MiMo's k_proj (one 24-wide head) ends in a short block
    "glm4_moe": glm4_hf_config,  # compressed-tensors, as GLM-4.5's FP8 checkpoints
    "mimo_v2_flash": mimo_hf_config,  # its every o_proj left in bf16 (ignored_layers)
}
BLOCKS = {family: 16 for family in HF_CONFIGS}
PROMPTS = [[(11 * i + 5) % 96 for i in range(n)] for n in (9, 3)]
GREEDY = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
MODES = ("none", "tbo", "tbo+two-chunk", "sbo", "dbo")
KW = dict(max_num_batched_tokens=8)  # chunked prefill: TBO and two-chunk get cut sequences


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> dict[str, Path]:
    """The five tiny FP8 checkpoints (DeepSeek-V3's, GLM-4.5's and MiMo-V2-Flash's through the
    command line)."""
    root = tmp_path_factory.mktemp("fp8")
    paths = {}
    for family, make in HF_CONFIGS.items():
        config = root / f"{family}.json"
        config.write_text(json.dumps(make().to_dict()))
        argv = ["make-model", "--hf-config", str(config), "--out", str(root / family)]
        assert main([*argv, "--quantize", "fp8", "--fp8-block", "16"]) == 0
        paths[family] = root / family
    for family, config in CONFIGS.items():
        out = paths[family] = root / family
        if family == "deepseek_v3":
            argv = ["make-model", "--hf-config", config, "--out", str(out), "--quantize", "fp8"]
            assert main([*argv, "--fp8-block", "32"]) == 0
            continue
        save_checkpoint(build_model(ModelConfig.from_hf(config)), out)
        quantize_checkpoint(out, (32, 32))
    return paths


@pytest.fixture(scope="module")
def one_process(fp8) -> dict[str, list]:
    """Each checkpoint's one-process run (FP8 dequantized at load), the reference of every
    layout."""
    outs = {}
    for family, path in fp8.items():
        with LLM(path, **KW) as llm:
            outs[family] = llm.generate(PROMPTS, GREEDY, return_logits=True)
    return outs


def _dequantized_copy(path: Path, out: Path, by_transformers: bool, block: int = 32) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors = load_file(str(path / "model.safetensors"))
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale_inv", "_scale")):
            continue
        scale = tensors.get(f"{name}_scale_inv", tensors.get(f"{name}_scale"))
        if scale is None:
            plain[name] = tensor
        elif by_transformers:
            plain[name] = Fp8Dequantize(None)._dequantize_one(tensor, scale, torch.float32)
        else:  # each element times its block's scale, short blocks at the ends
            grid = scale.repeat_interleave(block, 0)[: tensor.shape[0]]
            plain[name] = tensor.float() * grid.repeat_interleave(block, 1)[:, : tensor.shape[1]]
    out.mkdir()
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (out / "config.json").write_text(json.dumps(raw))


def test_transformers_dequantizes_a_non_dividing_grid_wrongly_or_not_at_all(fp8):
    """transformers' ``Fp8Dequantize`` takes the block from the grid (rows / grid rows): 40 rows
    in 2 blocks of 32 become 2 blocks of 20, silently wrong; where the grid does not divide the
    rows (40 in 3 blocks of 16, as DeepSeek-V3's 576 rows in 5 of 128) it raises."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors = load_file(str(fp8["deepseek_v3"] / "model.safetensors"))
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    q, scale = tensors[name], tensors[f"{name}_scale_inv"]
    assert q.shape == (40, 128) and scale.shape == (2, 4)
    theirs = Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32)
    assert not torch.equal(theirs, dequantize(q, scale, (32, 32)))
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        Fp8Dequantize(None)._dequantize_one(q, torch.ones(3, 8))


@pytest.mark.parametrize("family", [*CONFIGS, *HF_CONFIGS])
def test_one_process_matches_transformers(fp8, one_process, family, tmp_path):
    theirs = family in ("qwen3_moe", "qwen3_5_moe")  # transformers' op gets the others wrong
    _dequantized_copy(fp8[family], tmp_path / "plain", theirs, BLOCKS.get(family, 32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    for prompt, out in zip(PROMPTS, one_process[family], strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert max_abs_diff(out.prompt_logits, ref) <= 1e-4, len(prompt)
        assert out.token_ids[0] == ref[-1].argmax().item()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe", *HF_CONFIGS])
def test_every_mode_at_ep2_equals_one_process(fp8, one_process, family):
    """One ep=2 engine runs every mode with the weights kept in FP8 (each rank its experts and
    their scales), against one process dequantizing at load; Qwen3.5's linear attention under
    cut sequences too, GLM-4.5's compressed-tensors scales and MiMo-V2-Flash's bf16 o_proj
    beside FP8 q/k/v."""
    with LLM(fp8[family], ep=2, fp8_dequant_on_the_fly=True, **KW) as llm:
        for mode in MODES:
            force_overlap(llm, every_mode()[mode])
            got = llm.generate(PROMPTS, GREEDY, return_logits=True)
            for a, b in zip(one_process[family], got, strict=True):
                assert a.token_ids == b.token_ids, mode
                assert max_abs_diff(a.prompt_logits, b.prompt_logits) <= 1e-4, mode


def test_fp8_weights_with_fp8_dispatch_at_ep2_equal_one_process(fp8):
    """The whole FP8 path: an FP8 checkpoint (kept in FP8 on the ranks) with FP8 rows on the
    dispatch, every mode at ep=2 against one process quantizing the experts' rows at the same
    point (1e-4, the same tokens)."""
    fp8_rows = dict(moe_dispatch_dtype="fp8")
    with LLM(fp8["deepseek_v3"], **KW, **fp8_rows) as llm:
        base = llm.generate(PROMPTS, GREEDY, return_logits=True)
    with LLM(fp8["deepseek_v3"], ep=2, fp8_dequant_on_the_fly=True, **KW, **fp8_rows) as llm:
        for mode in MODES:
            force_overlap(llm, dataclasses.replace(every_mode()[mode], **fp8_rows))
            got = llm.generate(PROMPTS, GREEDY, return_logits=True)
            for a, b in zip(base, got, strict=True):
                assert a.token_ids == b.token_ids, mode
                assert max_abs_diff(a.prompt_logits, b.prompt_logits) <= 1e-4, mode


def test_tp2_cuts_blocks_with_their_scales(fp8, one_process):
    """TP 2 with the weights kept in FP8: q_b_proj's 96 rows split at 48, inside a 32-row block
    (each rank keeps its rows' scales); o_proj's and the experts' down_proj columns split on a
    block boundary. Same tokens and logits as one process."""
    with LLM(fp8["deepseek_v3"], tp=2, fp8_dequant_on_the_fly=True, **KW) as llm:
        got = llm.generate(PROMPTS, GREEDY, return_logits=True)
    for a, b in zip(one_process["deepseek_v3"], got, strict=True):
        assert a.token_ids == b.token_ids
        assert max_abs_diff(a.prompt_logits, b.prompt_logits) <= 1e-4


def test_on_the_fly_keeps_fp8_resident_and_equals_the_default(fp8):
    """The weights kept in FP8 (one byte each, plus a float32 scale per row and 32 columns) are
    rebuilt bit for bit as the default load's; the router and norms are not quantized."""
    cfg = ModelConfig.from_hf(fp8["qwen3_moe"] / "config.json")
    default = build_model(cfg, fp8["qwen3_moe"])
    resident = build_model(cfg, fp8["qwen3_moe"], fp8_on_the_fly=True)
    for name in ("self_attn.q_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        module, _, attr = f"model.layers.1.{name}".rpartition(".")
        kept = resident.get_submodule(module)
        assert kept.parametrizations[attr].original.dtype == torch.float8_e4m3fn, name
        assert torch.equal(getattr(default.get_submodule(module), attr), getattr(kept, attr))
    assert not hasattr(resident.model.layers["1"].mlp.gate, "parametrizations")
    held, bf16 = resident_bytes(resident)
    assert bf16 > 0 and held / bf16 == pytest.approx((1 + 4 / 32) / 2)
    # Qwen3.5's fused linear-attention projection, one rank's whole: resident too
    hybrid = fp8["qwen3_5_moe"]
    kept = build_model(ModelConfig.from_hf(hybrid / "config.json"), hybrid, fp8_on_the_fly=True)
    qkv = kept.model.layers["0"].linear_attn.in_proj_qkv
    assert qkv.parametrizations["weight"].original.dtype == torch.float8_e4m3fn


def test_a_load_allocates_the_model_once_and_holds_one_checkpoint_tensor(fp8, monkeypatch):
    """The load streams: every parameter is allocated at its final size (bf16, float32 routers,
    FP8 kept resident) before the first tensor is read, and each checkpoint tensor read is
    dropped before the next (``scripts/fp8_load_peak.py`` measures the peak this gives)."""
    cfg = ModelConfig.from_hf(fp8["qwen3_moe"] / "config.json")
    read, fill, skeleton = loader._read, loader.fill, loader.skeleton
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    seen: dict = {"alive": 0, "first fill": [], "models": []}

    def reading(*args):
        seen["alive"] = max(seen["alive"], len(alive))  # earlier reads still held
        alive.add(value := read(*args))
        return value

    def filling(*args):
        if not seen["first fill"]:
            seen["first fill"].append(_param_bytes(seen["models"][-1]))
        fill(*args)

    monkeypatch.setattr(loader, "_read", reading)
    monkeypatch.setattr(loader, "fill", filling)

    def building(*args):
        seen["models"].append(skeleton(*args))
        return seen["models"][-1]

    monkeypatch.setattr(loader, "skeleton", building)
    model = build_model(cfg, fp8["qwen3_moe"], dtype=torch.bfloat16, fp8_on_the_fly=True)
    assert seen["first fill"] == [_param_bytes(model)] and seen["alive"] == 0
    kinds = {p.dtype for p in model.parameters()}
    assert kinds == {torch.bfloat16, torch.float32, torch.float8_e4m3fn}  # float32: the routers


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_bad_checkpoints_get_named_errors(fp8, tmp_path):
    source = fp8["qwen3_moe"]
    cfg = ModelConfig.from_hf(source / "config.json")
    raw = json.loads((source / "config.json").read_text())
    int4 = {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}
    refused = {
        "awq": ({"quant_method": "awq"}, "quant_method='awq'"),
        "mxfp4": ({"quant_method": "mxfp4"}, "quant_method='mxfp4'.*Mxfp4Config"),  # GPT-OSS
        "w4a16": (
            {"quant_method": "compressed-tensors", "config_groups": {"group_0": int4}},
            "'int' 4-bit, strategy='group'",
        ),
    }
    for case, (quant, error) in refused.items():
        (tmp_path / case).mkdir()
        (tmp_path / case / "config.json").write_text(
            json.dumps(raw | {"quantization_config": quant})
        )
        with pytest.raises(ConfigError, match=error):
            LLM(tmp_path / case)
    with pytest.raises(ConfigError, match="needs an FP8 checkpoint, and --hf-config .* seeds"):
        LLM(hf_config="configs/qwen3-moe-tiny.json", quantization="fp8")
    with pytest.raises(ConfigError, match=r"Load a bf16 checkpoint, or plan"):  # no fix to add
        LLM(tmp_path / "awq")
    tensors = load_file(str(source / "model.safetensors"))
    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    bad = {
        "missing": {k: v for k, v in tensors.items() if k != scale},
        "grid": tensors | {scale: torch.ones(4, 3)},
    }
    errors = {
        "missing": r"'model.layers.1.self_attn.o_proj.weight' is float8_e4m3fn but its scale",
        "grid": r"has shape \(4, 3\); weight .* of shape \(128, 128\) in blocks of \[32, 32\] "
        r"needs \(4, 4\)",
    }
    for case, content in bad.items():
        path = tmp_path / case
        shutil.copytree(source, path)
        save_file(content, str(path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=errors[case]):
            build_model(cfg, path)


def test_fp8_weights_without_a_quantization_config_are_refused(fp8, tmp_path):
    """An FP8 checkpoint whose config.json lost its ``quantization_config`` (or has ``null``
    or ``{}`` there) is refused, naming the tensor: its FP8 values were read without their
    scales, and the model ran on wrong weights."""
    raw = json.loads((fp8["qwen3_moe"] / "config.json").read_text())
    for case, quant in {"missing": ..., "null": None, "empty": {}}.items():
        path = tmp_path / case
        shutil.copytree(fp8["qwen3_moe"], path)
        config = {k: v for k, v in raw.items() if k != "quantization_config"}
        if quant is not ...:
            config["quantization_config"] = quant
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=r"'model\.layers\.0\..*float8_e4m3fn, but "):
            LLM(path)


def test_a_malformed_compressed_tensors_config_is_refused_by_name():
    """config_groups or a group that is no JSON object is refused with the method's message,
    not an AttributeError from reading it."""
    base = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    for groups in ([1], {"group_0": "x"}, {"group_0": {"weights": "x"}}, "x"):
        with pytest.raises(ConfigError, match="quant_method='compressed-tensors' with format="):
            quant_config_of({"quantization_config": base | {"config_groups": groups}}, "ckpt")


def test_per_tensor_and_per_channel_scales_load(fp8, tmp_path, caplog):
    """``quant_method: fp8`` without a block size: ``weight_scale`` per tensor or per output
    row; the same tensors as a ``compressed-tensors`` checkpoint. The load log says the weights
    were dequantized, and how many bytes they hold."""
    source = fp8["qwen3_moe"]
    tensors = load_file(str(source / "model.safetensors"))
    cfg = ModelConfig.from_hf(source / "config.json")
    loaded = {}
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        w = dequantize(tensors[weight], tensors.pop(name), (32, 32))
        per_row = "experts" in weight  # experts per channel, the rest per tensor
        amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax().reshape(1)
        scale = amax / 448
        tensors[weight] = (w / scale).to(torch.float8_e4m3fn)
        tensors[f"{weight}_scale"] = scale
        loaded[weight] = tensors[weight].float() * scale
    path = tmp_path / "per_tensor"
    shutil.copytree(source, path)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]["weight_block_size"]
    (path / "config.json").write_text(json.dumps(raw))
    with caplog.at_level("INFO", logger="moe_overlap.model.fp8_resident"):
        model = build_model(cfg, path, progress=True)
    assert "112 quantized weights dequantized once at load to float32" in caplog.text
    layer = "model.layers.0.mlp.experts"
    assert torch.equal(
        model.model.layers["0"].self_attn.o_proj.weight,
        loaded["model.layers.0.self_attn.o_proj.weight"],
    )
    expert = model.get_parameter(f"{layer}.down_proj")[3]
    assert torch.equal(expert, loaded[f"{layer}.3.down_proj.weight"])
    weights = {"type": "float", "num_bits": 8, "strategy": "channel"}  # GLM-4.5-FP8's layout
    raw["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": weights}},
    }
    (path / "config.json").write_text(json.dumps(raw))
    again = build_model(cfg, path)
    assert torch.equal(again.get_parameter(f"{layer}.down_proj")[3], expert)


def test_the_w8a8_path_is_never_taken_on_cpu_and_falls_back_where_it_cannot_run(tmp_path):
    """The engine on CPU dequantizes (``fp8_path``); W8A8 forced onto CPU linears and expert
    banks (where torch has no block-scaled FP8 GEMM) falls back to the dequantized weights, bit
    for bit."""
    cfg = ModelConfig.from_hf(CONFIGS["qwen3_moe"])
    cfg = dataclasses.replace(cfg, moe_intermediate_size=128)  # the experts fit 128x128 too
    save_checkpoint(build_model(cfg), tmp_path)
    quantize_checkpoint(tmp_path, (128, 128))
    quant = quant_config_of(json.loads((tmp_path / "config.json").read_text()), "tiny")
    assert fp8_path(quant, "cpu", on_the_fly=False).startswith("FP8 weights dequantized once")
    model = build_model(cfg, tmp_path)
    assert not any(isinstance(m, W8A8Linear) for m in model.modules())
    forced = MoeForCausalLM(cfg)
    resident = load_checkpoint(forced, tmp_path, keep_fp8=True).resident
    assert keep_resident(forced, resident, torch.float32, w8a8=True) > 0
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ours, theirs = (
        forced.model.layers["0"].self_attn.q_proj,
        model.model.layers["0"].self_attn.q_proj,
    )
    assert torch.equal(ours(x), theirs(x)) and ours.w8a8.failed
    ours, theirs = forced.model.layers["1"].mlp.experts, model.model.layers["1"].mlp.experts
    assert torch.equal(ours(x, [2, 0, 1, 0, 0, 0, 0, 0]), theirs(x, [2, 0, 1, 0, 0, 0, 0, 0]))
    assert ours.w8a8.failed and theirs.w8a8 is None
    xq, scale = quantize_activations(x)
    # e4m3 keeps 3 mantissa bits (a normal value within 1/16), and a value below its smallest
    # normal (2^-6 of a scale) to steps of 2^-9 of its scale: random values fall there at times
    step = scale.repeat_interleave(128, 1)
    error = (xq.float() * step - x).abs()
    assert (error <= torch.maximum(x.abs() / 16, step * 2**-10)).all()


def test_on_the_fly_refuses_a_column_shard_inside_a_block():
    """A RowLinear's shard starting at column 32 of blocks of 48 cannot take whole column
    blocks of scales: refused with the fix (the default load cuts any shard)."""
    kept = {"o_proj.weight": 48}
    entry = Entry("o_proj.weight", "o_proj.weight", torch.zeros(16, 32), Shard(1, 32, 64))
    with pytest.raises(ConfigError, match="column 32, inside a scale block of 48.*drop --fp8"):
        column_block([entry], kept)
    assert column_block([dataclasses.replace(entry, shard=Shard(0, 8, 32))], kept) == 48


def test_the_fp8_gemm_pads_what_cublas_needs_aligned():
    """The activations' rows padded to a multiple of 4 (their 1x128 scales' leading dimension
    with them), the weight grid's column blocks padded with ones; never taken off a GPU."""
    x = torch.randn(5, 768)
    xq, scale = quantize_activations(x, row_multiple=4)
    assert xq.shape == (8, 768) and scale.shape == (8, 6) and scale.stride() == (1, 8)
    assert not xq[5:].float().any()
    grid = torch.rand(3, 16, 6) + 0.5
    padded = pad_grid(grid)
    assert padded.shape == (3, 16, 8) and padded.is_contiguous()
    assert torch.equal(padded[..., :6], grid) and bool((padded[..., 6:] == 1).all())
    assert pad_grid(torch.ones(16, 16)).shape == (16, 16)
    assert not gemm_works(torch.device("cpu"))
