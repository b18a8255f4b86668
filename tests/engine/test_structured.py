"""Structured outputs in the engine: the bitmask's layout on the rank, the constraint's own
checks, and ``LLM.generate`` with each kind of constraint (the server's ways of asking, at ep=2
with TBO and preemptions, are in tests/server/test_structured.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moe_overlap import LLM, InvalidRequestError, ModelConfig, SamplingParams, StructuredOutputs
from moe_overlap.core.errors import NOTHING_ALLOWED
from moe_overlap.engine.tokenizer import write_tokenizer
from moe_overlap.runtime.sampler import masked
from tests.helpers import TINY

CFG = {**TINY["qwen3_moe"], "vocab_size": 320, "max_position_embeddings": 256, "eos_token_id": 1}


def test_the_bitmask_keeps_exactly_the_tokens_whose_bits_are_set():
    allowed = [0, 31, 32, 40, 63]
    words = np.zeros(2, dtype=np.uint32)  # 64 tokens' bits; the row is wider: those are masked
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    row = masked(torch.randn(70), [words.view(np.int32).tobytes()])
    assert torch.isfinite(row).nonzero().flatten().tolist() == allowed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 3]}, "choice"),
        ({"regex": ""}, "regex"),
        ({"json": {"a": {1, 2}}}, "not JSON"),
    ],
)
def test_a_constraint_must_be_exactly_one_valid_value(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        StructuredOutputs(**kwargs, field="guided")
    assert caught.value.field == "guided"


def test_generate_follows_each_kind_of_constraint_and_refuses_what_cannot_compile(tmp_path):
    write_tokenizer(tmp_path, CFG["vocab_size"])
    kinds = [
        (StructuredOutputs(regex=r"[a-c]{2,6}x"), lambda t: re.fullmatch(r"[a-c]{2,6}x", t)),
        (StructuredOutputs(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
        (StructuredOutputs(grammar='root ::= "(" [0-9] ")"'), lambda t: re.fullmatch(r"\(\d\)", t)),
        (StructuredOutputs(json={"enum": [1, 2]}), lambda t: t in ("1", "2")),
    ]
    asks = [
        SamplingParams(max_new_tokens=24, seed=seed, temperature=temperature, structured_outputs=so)
        for so, _ in kinds
        for seed, temperature in ((0, 0.0), (1, 1.0))
    ]
    with LLM(config=ModelConfig(**CFG), seed=0, tokenizer=tmp_path) as llm:
        outs = llm.generate(["Answer:"] * len(asks), asks)
        bad = SamplingParams(structured_outputs=StructuredOutputs(regex="(", field="guided_regex"))
        with pytest.raises(InvalidRequestError, match="prompt 0: guided_regex") as caught:
            llm.generate(["Answer:"], bad)
    assert caught.value.field == "guided_regex"
    checks = [matches for _, matches in kinds for _ in range(2)]
    for matches, out in zip(checks, outs, strict=True):
        assert out.finish_reason in ("eos", "stop") and matches(out.text), out.text
    with LLM(config=ModelConfig(**CFG), seed=0) as llm, pytest.raises(InvalidRequestError) as no:
        llm.generate([[5, 6]], SamplingParams(structured_outputs=StructuredOutputs(regex="a")))
    assert "needs a model with a tokenizer" in str(no.value)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_can_only_end_before_min_tokens_fails_saying_why(tmp_path, temperature):
    """Only EOS follows "yes", and min_tokens holds EOS back: nothing is left to draw, which
    fails the request naming min_tokens, not with a draw the grammar refuses (token 0) or
    torch's error on an all -inf row."""
    write_tokenizer(tmp_path, CFG["vocab_size"])
    so = StructuredOutputs(choice=["yes"])
    ask = SamplingParams(
        max_new_tokens=30, min_tokens=25, temperature=temperature, structured_outputs=so
    )
    with LLM(config=ModelConfig(**CFG), seed=0, tokenizer=tmp_path) as llm:
        (out,) = llm.generate(["Answer:"], ask)
        assert llm.generate(["Answer:"], SamplingParams(structured_outputs=so))[0].text == "yes"
    assert out.finish_reason == "error" and out.text == "yes"
    assert out.error == NOTHING_ALLOWED
