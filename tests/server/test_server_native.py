"""SGLang's native routes and vLLM's token routes: the same engine path as the OpenAI ones,
SGLang's shapes, and a 400 naming every field they do not honour."""

from __future__ import annotations

import http.client
import json

import pytest

from moe_overlap.engine.llm import LLM
from tests.server.test_server import CFG, KEY, Running, served_model

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = Running(LLM(served_model(tmp_path_factory, "native"), max_num_seqs=4), api_key=KEY)
    yield run
    run.stop()
    assert run.error is None


def call(run: Running, path: str, body: dict | None = None, auth: bool = True):
    conn = http.client.HTTPConnection("127.0.0.1", run.port, timeout=60)
    data = None if body is None else json.dumps(body).encode()
    conn.request("GET" if body is None else "POST", path, data, AUTH if auth else {})
    resp = conn.getresponse()
    raw = resp.read().decode()
    return resp.status, raw


def post(run: Running, path: str, body: dict | None = None) -> tuple[int, object]:
    code, raw = call(run, path, body)
    return code, json.loads(raw)


def test_generate_is_the_completion_in_sglang_shape(served) -> None:
    sglang_bench = {"lora_path": None, "return_routed_experts": False, "logprob_start_len": -1}
    body = {"text": "the river", "sampling_params": GREEDY, **sglang_bench}  # as bench_serving
    code, native = post(served, "/generate", body)
    assert code == 200, native
    body = {"prompt": "the river", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    code, openai = post(served, "/v1/completions", body)
    assert code == 200
    choice = openai["choices"][0]
    assert native["text"] == choice["text"] and native["output_ids"] == choice["token_ids"]
    meta = native["meta_info"]
    assert meta["completion_tokens"] == 5 and meta["finish_reason"] == {"type": "length"}
    assert meta["prompt_tokens"] == openai["usage"]["prompt_tokens"]
    # token ids in, n and a batch of prompts out as a list
    ids = {"input_ids": [[3, 4, 5], [6, 7]], "sampling_params": {**GREEDY, "n": 2}}
    code, many = post(served, "/generate", ids)
    assert code == 200 and isinstance(many, list) and len(many) == 4
    assert many[0]["output_ids"] == many[1]["output_ids"]  # greedy: the two choices agree


def test_generate_streams_cumulative_text_and_logprobs(served) -> None:
    body = {"text": "the sea", "sampling_params": GREEDY, "stream": True, "return_logprob": True}
    code, raw = call(served, "/generate", body)
    assert code == 200
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    code, whole = post(served, "/generate", {**body, "stream": False})
    assert texts[-1] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    logprobs = whole["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == whole["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in logprobs)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": "hi", "sampling_params": {"no_stop_trim": True}}, "sampling_params"),
        ({"text": "hi", "regex": "[a-z]+"}, "regex"),
        ({"text": "hi", "lora_path": "adapter"}, "lora_path"),
        ({"text": "hi", "return_routed_experts": True}, "return_routed_experts"),
        ({"text": "hi", "input_ids": [1]}, "text"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "sampling_params"),
        ({"text": "hi", "sampling_params": {"temperature": True}}, "sampling_params"),
        ({"text": "hi", "logprob_start_len": 0}, "logprob_start_len"),
    ],
)
def test_what_generate_does_not_honour_is_a_400_naming_it(served, body, param) -> None:
    code, reply = post(served, "/generate", body)
    assert code == 400 and reply["error"]["param"] == param, reply


def tokens_text(served, tokens: list[int]) -> str:
    return post(served, "/detokenize", {"tokens": tokens})[1]["prompt"]


def test_tokenize_detokenize_and_the_info_routes(served) -> None:
    code, tokens = post(served, "/tokenize", {"prompt": "where is the fox"})
    assert code == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    code, text = post(served, "/detokenize", {"tokens": tokens["tokens"]})
    assert code == 200 and text["prompt"].strip() == "where is the fox"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    code, templated = post(served, "/tokenize", chat)
    assert code == 200 and templated["count"] > 1
    # with the chat route's template inputs, the count is the prompt chat would run
    open_turn = {"messages": [*chat["messages"], {"role": "assistant", "content": "The fox"}]}
    open_turn |= {"add_generation_prompt": False, "continue_final_message": True}
    open_turn["tools"] = [{"type": "function", "function": {"name": "f"}}]
    code, continued = post(served, "/tokenize", open_turn)
    ask = {**open_turn, "max_tokens": 1, "tool_choice": "none"}
    reply = post(served, "/v1/chat/completions", ask)[1]
    assert code == 200 and continued["count"] == reply["usage"]["prompt_tokens"]
    assert tokens_text(served, continued["tokens"]).endswith("assistant\nThe fox")
    code, reply = post(served, "/detokenize", {"tokens": [10**6]})
    assert code == 400 and reply["error"]["param"] == "tokens"
    code, reply = post(served, "/tokenize", {"prompt": "a", "model": "other"})
    assert code == 404
    code, info = post(served, "/get_model_info")
    assert code == 200 and info["is_generation"] and info["served_model_name"] == "tiny"
    code, server = post(served, "/get_server_info")
    assert code == 200 and "api_key" not in server and server["max_num_seqs"] == 4
    assert post(served, "/flush_cache", {})[0] == 200
    code, health = post(served, "/health_generate")
    assert code == 200 and health == {"status": "ok"}
    assert call(served, "/generate", {"text": "hi"}, auth=False)[0] == 401


def test_a_repeated_prompt_hits_the_prefix_cache_until_flush_cache(served) -> None:
    one = {**GREEDY, "max_new_tokens": 1}
    prompt = {"input_ids": list(range(3, 43)), "sampling_params": one}  # 2 full pages + 8
    first = post(served, "/generate", prompt)[1]
    before = post(served, "/get_server_info")[1]
    again = post(served, "/generate", prompt)[1]
    hit = post(served, "/get_server_info")[1]
    assert again["output_ids"] == first["output_ids"]
    assert (first["meta_info"]["cached_tokens"], again["meta_info"]["cached_tokens"]) == (0, 32)
    assert hit["prefix_cache_queries"] - before["prefix_cache_queries"] == 40
    assert hit["prefix_cache_hits"] - before["prefix_cache_hits"] == 32  # both full pages
    assert 0 < hit["cache_hit_rate"] <= 1 and hit["cached_pages"] >= 2
    assert post(served, "/flush_cache", {})[0] == 200
    flushed = post(served, "/generate", prompt)[1]
    after = post(served, "/get_server_info")[1]
    assert flushed["output_ids"] == first["output_ids"]
    assert after["prefix_cache_hits"] == hit["prefix_cache_hits"]  # nothing was left to find


def test_expert_distribution_record_start_stop_dump_and_metrics(served) -> None:
    code, _ = post(served, "/start_expert_distribution_record", {})
    assert code == 200
    ids = {"input_ids": [[3, 4, 5]], "sampling_params": {**GREEDY, "max_new_tokens": 2}}
    assert post(served, "/generate", ids)[0] == 200
    assert post(served, "/stop_expert_distribution_record", {})[0] == 200
    assert post(served, "/generate", ids)[0] == 200  # not counted
    code, dump = post(served, "/dump_expert_distribution_record", {})
    assert code == 200, dump
    top_k = CFG["num_experts_per_tok"]  # 4 tokens routed: 3 of the prompt, 1 decoded
    assert [sum(layer) for layer in dump["load"]] == [4 * top_k] * len(dump["layers"])
    assert dump["balancedness"] == [1.0] * len(dump["layers"])  # one rank
    code, text = call(served, "/metrics")
    assert code == 200 and 'moe_overlap_expert_balancedness{layer="0"} 1.0' in text
