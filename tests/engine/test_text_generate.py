"""LLM.generate with text: prompts as strings or ids, outputs with text, stop strings and stop
token ids, and the engine left as before by a bad or failing call."""

from __future__ import annotations

import pytest

from moe_overlap import LLM, InvalidRequestError, ModelConfig, SamplingParams
from moe_overlap.engine.tokenizer import write_tokenizer
from moe_overlap.model.loader import build_model, save_checkpoint
from tests.helpers import TINY

# the tiny Qwen3 with room for a byte-level tokenizer
CFG = {**TINY["qwen3_moe"], "vocab_size": 320, "max_position_embeddings": 128, "eos_token_id": 1}
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("text_model")
    save_checkpoint(build_model(ModelConfig(**CFG), seed=0), path)
    write_tokenizer(path, CFG["vocab_size"])
    with LLM(path, max_num_batched_tokens=8) as engine:
        yield engine


def test_text_and_ids_give_the_same_output_with_its_text(llm):
    ids = llm.tokenizer.encode("The fox counted", add_special_tokens=False)
    by_text, by_ids = llm.generate(["The fox counted", ids], GREEDY)
    assert by_text.prompt_ids == ids and by_text.token_ids == by_ids.token_ids
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert len(by_text.token_ids) == 10 and by_text.finish_reason == "length"


def test_one_text_prompt_alone_is_one_prompt(llm):
    """As vLLM takes it: a bare string is one prompt, not a list of characters."""
    (alone,) = llm.generate("The fox counted", GREEDY)
    assert alone.token_ids == llm.generate(["The fox counted"], GREEDY)[0].token_ids
    with pytest.raises(InvalidRequestError, match="prompts must be a list of prompts"):
        llm.generate(7, GREEDY)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="params must be SamplingParams or a list"):
        llm.generate(["a"], (p for p in [GREEDY]))  # type: ignore[arg-type]


def test_stop_string_cuts_the_text_and_finishes(llm):
    full = llm.generate(["Hello"], GREEDY)[0]
    stop = full.text[len(full.text) // 2 :][:2]
    out = llm.generate(
        ["Hello"], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, stop=stop)
    )
    assert out[0].finish_reason == "stop"
    assert out[0].text == full.text[: full.text.find(stop)]
    assert out[0].token_ids == full.token_ids[: len(out[0].token_ids)]


def test_a_stop_string_waits_for_min_tokens(llm):
    """As vLLM and SGLang: a stop string ending within the first min_tokens tokens does not
    end the output (the text of the first token would have stopped it at once)."""
    full = llm.generate(["Hello"], GREEDY)[0]
    first = llm.tokenizer.decode(full.token_ids[:1])
    assert first
    ask = dict(temperature=0, max_new_tokens=10, ignore_eos=True, stop=first)
    assert llm.generate(["Hello"], SamplingParams(**ask))[0].token_ids == full.token_ids[:1]
    out = llm.generate(["Hello"], SamplingParams(**ask, min_tokens=4))[0]
    assert len(out.token_ids) > 4 and out.token_ids == full.token_ids[: len(out.token_ids)]
    assert out.text == full.text[: len(out.text)] and len(out.text) > len(first)


def test_stop_token_id_is_kept_and_finishes(llm):
    full = llm.generate(["Hello"], GREEDY)[0]
    stop_id = full.token_ids[3]
    params = SamplingParams(
        temperature=0, max_new_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]
    )
    out = llm.generate(["Hello"], params)[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(stop=5), "stop=5 must be a list of strs"),
        (dict(stop_token_ids=["a"]), "stop_token_ids='a' must be an integer"),
        (dict(stop_token_ids=[-1]), "stop_token_ids=-1 must be an integer >= 0"),
    ],
)
def test_bad_stop_fields_are_named(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


def test_empty_text_prompt_is_refused_and_engine_stays_usable(llm):
    want = llm.generate(["Hello"], GREEDY)[0].token_ids
    with pytest.raises(InvalidRequestError, match="prompt 1 is empty"):
        llm.generate(["Hello", ""], GREEDY)
    assert not llm.scheduler.has_work()
    assert llm.generate(["Hello"], GREEDY)[0].token_ids == want


def test_failure_mid_generate_leaves_the_engine_as_before(llm, monkeypatch):
    want = llm.generate(["Hello", "The sky"], GREEDY)
    step, calls = llm.executor.step, []

    def failing(request):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return step(request)

    monkeypatch.setattr(llm.executor, "step", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["Hello", "The sky"], GREEDY)
    monkeypatch.undo()
    assert not llm.scheduler.has_work()
    again = llm.generate(["Hello", "The sky"], GREEDY)
    assert [o.text for o in again] == [o.text for o in want]


def test_stop_strings_without_a_tokenizer_are_refused():
    with (
        LLM(config=ModelConfig(**CFG)) as llm,
        pytest.raises(InvalidRequestError, match="prompt 0: stop strings need a model with a"),
    ):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]))
