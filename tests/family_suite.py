"""The checks every model family's test file runs: one process against transformers (logits
and greedy tokens, chunked prefill too), a ``make-model`` checkpoint transformers reads, every
overlap mode at ep=2 on gloo ranks and other layouts under two-chunk TBO, each against one
process without overlap."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.tools.cli import main
from tests.helpers import KW, PARAMS, every_mode, force_overlap, max_abs_diff

PROMPTS = [[(7 * i + 3) % 96 for i in range(n)] for n in (1, 37, 600)]
CASES = {
    "mixed-batch": [[9] * 12, [1, 2], list(range(30, 70)), [70, 71, 72], [5]],
    "single-long": [[(7 * i) % 80 for i in range(45)]],
}
BUDGETS = [None, 24]  # 24 tokens per forward: chunked prefill


def matches_transformers(path: Path, hf, budget: int | None, prompts=PROMPTS) -> None:
    """Our logits within 1e-4 of ``hf``'s and the same 4 greedy tokens, prompt by prompt."""
    kw = {} if budget is None else dict(max_num_batched_tokens=budget)
    with LLM(path, **kw) as llm:
        outs = llm.generate(prompts, PARAMS, return_logits=True)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
            gen = hf.generate(
                torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False
            )[0, len(prompt) :]
        assert max_abs_diff(out.prompt_logits, ref) <= 1e-4, len(prompt)
        assert out.token_ids == gen.tolist(), len(prompt)


def ep2_modes_match_one_process(cfg: ModelConfig, cases=CASES) -> None:
    """One ep=2 engine (one spawn) runs every mode; each matches one process without overlap."""
    with LLM(config=cfg, **KW) as one:
        base = {c: one.generate(p, PARAMS, return_logits=True) for c, p in cases.items()}
    with LLM(config=cfg, ep=2, **KW) as llm:
        for mode, overlap in every_mode().items():
            force_overlap(llm, overlap)
            for case, prompts in cases.items():
                got = llm.generate(prompts, PARAMS, return_logits=True)
                for a, b in zip(base[case], got, strict=True):
                    assert a.token_ids == b.token_ids, (mode, case)
                    assert max_abs_diff(a.prompt_logits, b.prompt_logits) <= 1e-4, (mode, case)


def made_model_matches_transformers(config: str, out: Path, prompt_len: int) -> None:
    """``make-model --hf-config config`` writes a checkpoint transformers loads and computes our
    logits for (within 1e-4) on one prompt of ``prompt_len`` tokens."""
    from transformers import AutoModelForCausalLM

    assert main(["make-model", "--hf-config", config, "--out", str(out)]) == 0
    prompt = [(11 * i + 5) % 512 for i in range(prompt_len)]
    with LLM(out) as llm:
        ours = llm.generate(
            [prompt], SamplingParams(temperature=0, max_new_tokens=1), return_logits=True
        )[0]
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert max_abs_diff(ours.prompt_logits, ref) <= 1e-4
    weights = (out / "model.safetensors").read_bytes()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # a checkpoint there already: refused, not replaced
        assert main(["make-model", "--hf-config", config, "--out", str(out), "--seed", "1"]) == 2
    assert "holds a checkpoint already" in err.getvalue() and "--overwrite" in err.getvalue()
    assert (out / "model.safetensors").read_bytes() == weights


def layout_matches_one_process(cfg: ModelConfig, layout: dict, base=None) -> None:
    """``layout`` (a dict of LLM arguments) under two-chunk TBO gives one process's tokens and
    logits (``base``: its outputs, when the caller has them) on the mixed batch."""
    if base is None:
        with LLM(config=cfg, **KW) as one:
            base = one.generate(CASES["mixed-batch"], PARAMS, return_logits=True)
    with LLM(config=cfg, overlap=mode_config("tbo+two-chunk"), **layout, **KW) as llm:
        got = llm.generate(CASES["mixed-batch"], PARAMS, return_logits=True)
    for a, b in zip(base, got, strict=True):
        assert a.token_ids == b.token_ids
        assert max_abs_diff(a.prompt_logits, b.prompt_logits) <= 1e-4
