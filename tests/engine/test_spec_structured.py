"""Structured outputs under speculative decoding: the grammar follows each n-gram draft to mask
the verify row after it, and cuts the drafts at the first it refuses. On real ep=2 gloo ranks a
JSON-schema and a regex request, greedy and seeded sampled, get exactly the tokens they get
without speculation in several overlap modes, with drafts checked, accepted and cut."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from moe_overlap import LLM, ModelConfig, SamplingParams, StructuredOutputs
from moe_overlap.core.batch import ForwardMode
from moe_overlap.engine.tokenizer import write_tokenizer
from tests.engine.test_speculative import _recording, _sequence_splits
from tests.helpers import TINY, every_mode

CFG = {**TINY["qwen3_moe"], "vocab_size": 320, "max_position_embeddings": 256, "eos_token_id": 1}
SCHEMA = {  # bounded, so a random model's output ends within NEW tokens
    "type": "object",
    "properties": {
        "c": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "l": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 4},
    },
    "required": ["c", "n", "l"],
}
REGEX = r"(ab|cd|ef)+x"
# prompts that hold what the grammar lets the output repeat, so the n-gram drafter finds it
JSON_PROMPT = '{"c": "red", "n": 7, "l": ["ab", "cd", "ab"]} {"c": "blue", "n": 12, "l": []}'
REGEX_PROMPT = "abcdabcdefabcd cdcdab x abababab"
NEW = 48
MODES = ("none", "tbo", "sbo", "dbo")


def _valid_json(text: str) -> bool:
    value = json.loads(text)
    return (
        list(value) == ["c", "n", "l"]
        and value["c"] in ("red", "green", "blue")
        and type(value["n"]) is int
        and 0 <= value["n"] <= 99
        and len(value["l"]) <= 4
        and all(v in ("ab", "cd") for v in value["l"])
    )


def _requests() -> tuple[list[str], list[SamplingParams]]:
    """A JSON-schema and a regex request, each greedy and seeded sampled, and one greedy
    request without a constraint in the same verify batches."""
    asks = [
        (JSON_PROMPT, StructuredOutputs(json=SCHEMA)),
        (REGEX_PROMPT, StructuredOutputs(regex=REGEX)),
    ]
    prompts, params = [], []
    for prompt, so in asks:
        for temperature, seed in ((0.0, 0), (1.0, 3)):
            prompts.append(prompt)
            params.append(SamplingParams(NEW, temperature, seed=seed, structured_outputs=so))
    prompts.append(JSON_PROMPT)
    params.append(SamplingParams(16, 0.0, ignore_eos=True))
    return prompts, params


def _tokens(bitmask: bytes) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(np.frombuffer(bitmask, np.uint8), bitorder="little")))


def _drafting(seen: list) -> tuple[int, int, int]:
    """Over the recorded steps, the structured sequences' drafts: checked (their grammar
    allowed them), cut (refused, with the ones after them) and accepted."""
    checked = cut = accepted = 0
    for _, _, samples, groups in seen:
        for group, reply in zip(samples or [], groups, strict=True):
            for spec, more in zip(group, reply.more_ids, strict=True):
                if spec.drafts and spec.allowed is not None:
                    checked += len(spec.checked_drafts)
                    cut += len(spec.drafts) - len(spec.checked_drafts)
                    accepted += len(more)
    return checked, cut, accepted


def test_structured_requests_are_speculated_exactly_at_ep2(tmp_path):
    write_tokenizer(tmp_path, CFG["vocab_size"])
    prompts, params = _requests()
    modes = every_mode()
    with LLM(
        config=ModelConfig(**CFG), ep=2, seed=0, tokenizer=tmp_path, speculative_algorithm="NGRAM"
    ) as llm:
        speculation, llm.scheduler.speculation = llm.scheduler.speculation, None
        free = llm.generate(prompts, params)
        llm.scheduler.speculation = speculation
        for mode in MODES:
            seen: list = []
            _recording(llm, modes[mode], seen)
            got = llm.generate(prompts, params)
            for a, b in zip(free, got, strict=True):  # seeded sampling: plain sampling's draws
                assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), mode
            assert any(b.mode == ForwardMode.TARGET_VERIFY for bs, *_ in seen for b in bs), mode
            checked, cut, accepted = _drafting(seen)
            assert checked > 0 and cut > 0 and accepted > 0, (mode, checked, cut, accepted)
            if mode == "tbo":
                assert _sequence_splits(seen) > 0  # verify batches cut by whole sequences
    for out in got[:2]:
        assert out.finish_reason in ("eos", "stop") and _valid_json(out.text), out.text
    for out in got[2:4]:
        assert out.finish_reason in ("eos", "stop") and re.fullmatch(REGEX, out.text), out.text


def test_the_matcher_masks_each_draft_row_and_cuts_at_the_first_refused(tmp_path):
    tokenizer = write_tokenizer(tmp_path, CFG["vocab_size"])
    a, b, x, z = (tokenizer.encode(s, add_special_tokens=False)[0] for s in "abxz")
    with LLM(config=ModelConfig(**CFG), tokenizer=tmp_path) as llm:
        constraints = llm.constraints
        made = [constraints.matcher(StructuredOutputs(regex="[ab]{2,3}x"), "t") for _ in range(3)]
    matcher = made[0]
    one = matcher.allowed()
    rows = matcher.allowed([a, b, z, a])  # z is refused: the rows after a and after a, b
    assert [_tokens(r) for r in rows] == [{a, b}, {a, b}, {a, b, x}]
    assert matcher.allowed() == one  # the drafts left its place in the grammar as it was
    ends = matcher.allowed([a, b, b, x, 1, a])  # the stop token (1) is not verified
    assert len(ends) == 5 and _tokens(ends[-1]) == {1}
    made[1].accept(a)
    drafts = [[a, b, z, a], [a, x, 1], []]
    together = constraints.allowed(made, drafts)  # a step's, filled by batched calls
    assert together == [m.allowed(d) for m, d in zip(made, drafts, strict=True)]
    assert together[0] == rows and [_tokens(r) for r in together[1]] == [{a, b}, {a, b, x}, {1}]
    assert together[2] == one
    with pytest.raises(ValueError, match="does not follow"):
        matcher.accept(x)
