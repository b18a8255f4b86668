"""No silent ignore: every request field vLLM's and SGLang's OpenAI-compatible servers define
is served here (a field of ``server/protocol.py``'s request models), refused with a 400 that
names it (``server/unsupported.py: REFUSED``), or a documented no-op (``NO_OPS``). The lists
below are written from their protocol models (vLLM's ``CompletionRequest`` and
``ChatCompletionRequest``, its older ``guided_*`` fields; SGLang's ``CompletionRequest`` and
``ChatCompletionRequest``), as of November 2026."""

from __future__ import annotations

import json

import pytest

from moe_overlap import LLM
from moe_overlap.server.protocol import ChatRequest, CompletionRequest
from moe_overlap.server.unsupported import NO_OPS, REFUSED
from tests.server.test_server import KEY, Running, served_model

_OPENAI = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop
    stream stream_options temperature top_p user"""
_VLLM_SAMPLING = """use_beam_search top_k min_p repetition_penalty length_penalty
    stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
    spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids
    bad_words response_format structured_outputs priority request_id return_tokens_as_token_ids
    return_token_ids cache_salt kv_transfer_params vllm_xargs guided_json guided_regex
    guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern"""
VLLM = {
    "completions": f"""{_OPENAI} {_VLLM_SAMPLING} prompt echo suffix truncation_side
        logprob_token_ids prompt_embeds add_special_tokens return_token_offsets
        ec_transfer_params repetition_detection thinking_token_budget""",
    "chat": f"""{_OPENAI} {_VLLM_SAMPLING} messages top_logprobs max_completion_tokens tools
        tool_choice reasoning_effort include_reasoning parallel_tool_calls echo
        add_generation_prompt continue_final_message add_special_tokens documents chat_template
        chat_template_kwargs mm_processor_kwargs logits_processors max_repetition_pattern_size
        min_repetition_pattern_size repetition_min_count""",
}
_SGLANG_BOTH = """return_hidden_states return_routed_experts routed_experts_start_len
    return_cached_tokens_details return_token_ids top_k min_p min_tokens regex ebnf
    repetition_penalty stop_token_ids stop_regex no_stop_trim ignore_eos skip_special_tokens
    lora_path session_id session_params response_format custom_params custom_logit_processor
    images_config bootstrap_host bootstrap_port bootstrap_room routed_dp_rank
    disagg_prefill_dp_rank data_parallel_rank rid extra_key cache_salt ngram_corpus_id priority"""
SGLANG = {
    "completions": f"""{_OPENAI} {_SGLANG_BOTH} prompt best_of echo suffix json_schema
        custom_labels""",
    "chat": f"""{_OPENAI} {_SGLANG_BOTH} messages top_logprobs max_completion_tokens tools
        tool_choice parallel_tool_calls return_prompt_token_ids return_meta_info
        reasoning_effort task continue_final_message separate_reasoning stream_reasoning
        chat_template_kwargs max_dynamic_patch min_dynamic_patch use_audio_in_video input_ids""",
}
SERVED = {"completions": CompletionRequest.model_fields, "chat": ChatRequest.model_fields}
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {
    "completions": {"prompt": "hi", "max_tokens": 1},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
}


def _anchor_fields(endpoint: str) -> set[str]:
    return set(VLLM[endpoint].split()) | set(SGLANG[endpoint].split())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_anchor_field_is_served_refused_or_a_documented_no_op(endpoint):
    served, refused = set(SERVED[endpoint]), set(REFUSED[endpoint])
    assert not served & refused, "a field both served and refused"
    assert not (served | refused) & set(NO_OPS), "a no-op that is also served or refused"
    unclassified = _anchor_fields(endpoint) - served - refused - set(NO_OPS)
    assert not unclassified, f"{endpoint}: fields the anchors define that nothing here names"


def _changes_something(name: str, endpoint: str) -> object:
    """A value of field ``name`` that is not one of its no-op values."""
    no_ops = REFUSED[endpoint][name][0]
    for value in (True, False, 3, 2.5, "x", ["x"], {"x": 1}):
        if not any(value is v if isinstance(v, bool) else value == v for v in no_ops):
            return value
    raise AssertionError(name)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = Running(LLM(served_model(tmp_path_factory, "fields"), max_num_seqs=2), api_key=KEY)
    yield run
    run.stop()
    assert run.error is None


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_refused_field_gets_a_400_naming_it_and_each_no_op_an_answer(served, endpoint):
    for name in sorted(REFUSED[endpoint]):
        body = {**BASE[endpoint], name: _changes_something(name, endpoint)}
        status, reply = served.raw("POST", ROUTES[endpoint], json.dumps(body).encode())
        assert status == 400, (name, reply)
        assert reply["error"]["param"] == name and name in reply["error"]["message"], reply
    # every refused field at its default and every no-op field at once: answered
    defaults = {name: no_ops[-1] for name, (no_ops, _) in REFUSED[endpoint].items()}
    body = {**BASE[endpoint], **defaults, **dict.fromkeys(NO_OPS, "x")}
    status, reply = served.raw("POST", ROUTES[endpoint], json.dumps(body).encode())
    assert status == 200 and reply["choices"], reply
