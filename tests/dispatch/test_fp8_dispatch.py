"""``--moe-dispatch-dtype fp8``: the quantizer's bounds and layout, and every overlap mode,
dispatch and layout on real gloo ranks equal to the one-process run of the same FP8 path."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from moe_overlap import LLM, ConfigError, ModelConfig
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.dispatch.emulated import EmulatedAllToAllDispatcher
from moe_overlap.dispatch.fp8_rows import FP8_MAX, Fp8Rows, dequantize, dispatch_rows, quantize
from moe_overlap.distributed.emulated import EmulatedGroup
from moe_overlap.distributed.modelled_link import ModelledLink
from moe_overlap.tools.cli import main
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, force_overlap, max_abs_diff

FP8 = dict(moe_dispatch_dtype="fp8")
MODES = {m: mode_config(m) for m in ("none", "tbo", "tbo+two-chunk", "sbo")} | {
    "dbo": OverlapConfig("dbo", dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4),
}
PROMPTS = CASES["mixed-batch"]  # prefill chunks, MIXED steps and decodes under KW's budget


def test_round_trip_within_fp8_precision_and_scales_per_token_group():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[1] = 0.0  # a zero row
    x[2, 128:256] = 0.0  # a zero group (amax 0) in a live row
    wire = Fp8Rows(300, torch.float32)
    assert (wire.group, wire.groups, wire.width) == (128, 3, 312)  # 300 + 3 * 4 bytes
    q, scales = quantize(x, wire.group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (6, 300)
    assert scales.dtype == torch.float32 and scales.shape == (6, 3)  # the last group: 44 cols
    amax = torch.stack([x[:, a : a + 128].abs().amax(1) for a in (0, 128, 256)], 1)
    assert torch.equal(scales, amax / FP8_MAX)
    packed = wire.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 312)
    back = wire.decode(packed)
    assert torch.equal(back, dequantize(q, scales, wire.group))  # the bytes lose nothing more
    assert torch.equal(back[1], x[1]) and torch.equal(back[2, 128:256], x[2, 128:256])
    # e4m3: 3 mantissa bits (half a step: 2**-4 of the value), subnormal steps 2**-9 * scale
    step = scales.repeat_interleave(128, 1)[:, :300] * 2**-10
    assert ((back - x).abs() <= x.abs() * 2**-4 + step).all()
    assert (back - x).abs().max() > 0  # lossy, honestly
    # rows whose width 128 divides, and the rows of a tiny model: one group of all its columns
    assert Fp8Rows(256, torch.float32).width == 256 + 8
    tiny = Fp8Rows(32, torch.bfloat16)
    assert (tiny.group, tiny.groups, tiny.width) == (32, 1, 36)
    rows = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
    assert tiny.decode(tiny.encode(rows).view(2, 2, 36)).shape == (2, 2, 32)
    assert tiny.decode(tiny.encode(rows)).dtype == torch.bfloat16


def test_about_half_the_bytes_of_bf16_rows():
    hidden = 7168  # DeepSeek-V3's row: 7168 FP8 bytes and 56 scales against 14336 bf16 bytes
    assert Fp8Rows(hidden, torch.bfloat16).width / (hidden * 2) == pytest.approx(
        (hidden + 4 * math.ceil(hidden / 128)) / (2 * hidden)
    )
    assert Fp8Rows(hidden, torch.bfloat16).width == 7392


def test_a_bad_dispatch_dtype_is_refused_by_name():
    with pytest.raises(ConfigError, match="--moe-dispatch-dtype='int8' must be one of auto, fp8"):
        OverlapConfig(moe_dispatch_dtype="int8")
    with pytest.raises(ConfigError, match="--moe-dispatch-dtype='bf16'"):
        dispatch_rows("bf16", 32, torch.float32)


def _generate(llm: LLM, overlap: OverlapConfig | None = None):
    if overlap is not None:
        force_overlap(llm, overlap)
    return llm.generate(PROMPTS, PARAMS, return_logits=True)


@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_ep2_every_mode_and_dispatch_equal_the_one_process_fp8_run(family):
    """none, TBO, two-chunk, SBO and DBO over the normal all-to-all, and the low-latency
    dispatch, at ep=2 on gloo (fp32 compute): the one-process FP8 run's logits (1e-4) and
    greedy tokens. The FP8 run is not the plain one: the rows really were quantized."""
    cfg = ModelConfig(**TINY[family])
    with LLM(config=cfg, **KW) as llm:
        plain = _generate(llm)
    with LLM(config=cfg, **KW, **FP8) as llm:
        base = _generate(llm)
    drift = max(
        max_abs_diff(a.prompt_logits, b.prompt_logits) for a, b in zip(base, plain, strict=True)
    )
    assert drift > 1e-3
    with LLM(config=cfg, ep=2, **KW, **FP8) as llm:
        for mode, overlap in MODES.items():
            for a2a in ("normal", "low_latency"):
                step = replace(overlap, a2a_mode=a2a, num_max_dispatch_tokens_per_rank=24)
                for a, b in zip(base, _generate(llm, step), strict=True):
                    assert a.token_ids == b.token_ids, (mode, a2a)
                    assert max_abs_diff(a.prompt_logits, b.prompt_logits) <= 1e-4, (mode, a2a)


def test_gather_under_dp_attention_equals_the_one_process_fp8_run():
    """The tensor-parallel MoE's dp_gather carries the FP8 bytes (all-reduce for extends,
    all-gather for decodes) and gives the one-process FP8 run."""
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with LLM(config=cfg, **KW, **FP8) as llm:
        base = _generate(llm)
    with LLM(config=cfg, tp=2, dp=2, enable_dp_attention=True, **KW, **FP8) as llm:
        assert_same(base, _generate(llm))


class CountingLink(ModelledLink):
    """A fast modelled link that notes the bytes of each transfer it is charged for."""

    def __init__(self) -> None:
        super().__init__(bytes_per_s=1e15)
        self.charged: list[int] = []

    def reserve(self, start_time: float, num_bytes: int) -> float:
        self.charged.append(num_bytes)
        return super().reserve(start_time, num_bytes)


def test_the_modelled_link_charges_the_fp8_rows_bytes_and_the_combine_the_run_dtypes():
    """rank 0 of an emulated ep=4: the dispatch's crossing rows cost ``width`` bytes each under
    FP8 (hidden FP8 bytes and a float32 scale per 128 columns), the combine's ``4 * hidden``."""
    hidden, tokens, experts = 256, 16, 8
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.randperm(experts, generator=gen)[:2].repeat(tokens, 1)  # 2 experts, 2 ranks
    weights = torch.full((tokens, 2), 0.5)
    charged, out = {}, {}
    for name, wire in (("auto", None), ("fp8", Fp8Rows(hidden, torch.float32))):
        link = CountingLink()
        a2a = EmulatedAllToAllDispatcher(
            EmulatedGroup(4, torch.device("cpu")), experts, link, None, wire
        )
        state = a2a.dispatch_a(x, ids, weights)
        a2a.dispatch_b(state)
        state.expert_outputs = state.expert_inputs * 2
        a2a.combine_a(state)
        out[name], charged[name] = a2a.combine_b(state), link.charged
    crossing = charged["auto"][0] // (4 * hidden)
    assert crossing > 0 and charged["auto"] == [crossing * 4 * hidden] * 2
    assert charged["fp8"] == [crossing * (hidden + 2 * 4), crossing * 4 * hidden]
    # what came back is twice the dequantized rows: the scales travelled with their rows
    rows = Fp8Rows(hidden, torch.float32)
    assert torch.equal(out["fp8"], 2 * rows.decode(rows.encode(x)))


def test_bench_compares_fp8_dispatch_with_the_run_dtypes_in_one_invocation(tmp_path, capsys):
    """Rank 0 of an emulated ep=2 over a modelled link: both dtypes' tables, the side-by-side
    one, and in the JSON the bytes each dtype's transfers put on the link."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--emulate-peers", "2"]
    argv += ["--link", "model:10mbit,0us", "--workload", "single-long:8", "--repeat", "1"]
    argv += ["--modes", "none,sbo", "--moe-dispatch-dtype", "fp8", "--compare-dispatch-dtype"]
    assert main([*argv, "--json", str(out), "--trace", str(tmp_path / "t.json")]) == 0
    printed = capsys.readouterr().out
    said = " ".join(printed.split())  # the console wraps long lines
    assert "(the --moe-dispatch-dtype fp8 run; --json holds every run)" in said  # the trace's
    assert "--moe-dispatch-dtype fp8" in printed and "--moe-dispatch-dtype auto" in printed
    assert "dispatch fp8 against auto" in printed and "T_comm auto / fp8" in printed
    data = json.loads(out.read_text())
    compared = data["compared"]
    assert data["moe_dispatch_dtype"] == "fp8" and set(compared) == {"fp8", "auto"}
    assert set(compared["fp8"]["modes"]) == set(compared["auto"]["modes"]) == {"none", "sbo"}
    assert compared["fp8"]["t_comm_s"] > 0 and compared["auto"]["t_comm_s"] > 0
    # the link carried FP8 rows (128 bytes and a 4-byte scale) out, fp32's 512 back: the bytes,
    # not the times, so the check holds on a loaded machine
    assert compared["fp8"]["comm_bytes"] / compared["auto"]["comm_bytes"] == (132 + 512) / 1024
