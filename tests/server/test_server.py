"""The OpenAI-compatible server, driven by the official ``openai`` client against a server on a
free local port: completion, chat, streaming, concurrency, errors, the API key, disconnects, a
dead rank and SIGTERM."""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from moe_overlap import LLM, ConfigError, ModelConfig, SamplingParams
from moe_overlap.engine.tokenizer import write_tokenizer
from moe_overlap.model.loader import build_model, save_checkpoint
from moe_overlap.runtime import sampler as sampler_module
from moe_overlap.runtime.sampler import sample
from moe_overlap.server.guards import ServerSettings
from moe_overlap.server.run import EngineStopped, Server
from moe_overlap.tools.bench_datasets import workload_requests
from moe_overlap.tools.bench_serve import Target, run_load
from moe_overlap.tools.bench_serve_cli import add_bench_serve_command
from moe_overlap.tools.serve_cli import add_serve_commands
from moe_overlap.tools.serving_metrics import percentile
from tests.helpers import TINY

# the tiny Qwen3 with room for a byte-level tokenizer
CFG = {**TINY["qwen3_moe"], "vocab_size": 320, "max_position_embeddings": 1024, "eos_token_id": 1}
KEY = "test-key"
SLOTS = 4  # per rank: 32 concurrent requests queue and join as slots free up
PROMPTS = [f"Question {i}: where is the {w}?" for i, w in enumerate(["river", "sea", "fox"] * 11)]
GREEDY = dict(temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A Server on its own thread; ``error`` holds what ``run`` raised."""

    def __init__(self, llm: LLM, **settings):
        self.port = _free_port()
        self.server = Server(llm, ServerSettings("tiny", **settings), port=self.port)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, self.error
            time.sleep(0.02)

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as exc:
            self.error = exc

    def client(self, key: str = KEY) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def raw(self, method: str, path: str, body: bytes | None = None, key: str = KEY):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(30)


def two_rank_server(model_dir, **settings):
    """A server on two expert-parallel ranks with TBO (a module fixture's body: ``yield
    from``), stopped at the end, having raised nothing."""
    llm = LLM(model_dir, ep=2, overlap="tbo", max_num_seqs=4, timeout_s=20)
    run = Running(llm, api_key=KEY, **settings)
    yield run
    run.stop()
    assert run.error is None


def served_model(tmp_path_factory, name: str):
    """The tiny served model with weights and a tokenizer, in a fresh directory."""
    path = tmp_path_factory.mktemp(name)
    save_checkpoint(build_model(ModelConfig(**CFG), seed=0), path)
    write_tokenizer(path, CFG["vocab_size"])
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return served_model(tmp_path_factory, "served")


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(model_dir) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(model_dir):
    run = Running(
        LLM(model_dir, max_num_seqs=SLOTS),
        api_key=KEY,
        max_prompt_tokens=200,
        max_request_bytes=4096,
    )
    yield run
    run.stop()
    assert run.error is None


def _offline(offline, prompts, max_new_tokens=6):
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return offline.generate(prompts, params)


def test_completion_equals_offline_generate(served, offline):
    got = served.client().completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY)
    want = _offline(offline, [PROMPTS[0]])[0]
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_ids) and got.usage.completion_tokens == 6


def test_token_id_prompts_and_batches(served, offline):
    ids = offline.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    got = served.client().completions.create(model="tiny", prompt=[ids, ids[:3]], **GREEDY)
    want = _offline(offline, [ids, ids[:3]])
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.model_extra["token_ids"] for c in got.choices] == [w.token_ids for w in want]


def test_chat_equals_offline_generate_of_the_chat_template(served, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    got = served.client().chat.completions.create(model="tiny", messages=messages, **GREEDY)
    text = offline.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert got.choices[0].message.content == _offline(offline, [text])[0].text
    assert got.choices[0].message.role == "assistant" and got.object == "chat.completion"


def test_streams_add_up_to_the_whole_answer(served):
    client = served.client()
    whole = client.completions.create(model="tiny", prompt=PROMPTS[2], **GREEDY)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[2],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == whole.choices[0].message.content


def test_continuous_usage_stats_puts_each_choices_usage_in_every_chunk(served, offline):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's usage
    so far; it was silently ignored."""
    client = served.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    prompts = [PROMPTS[5], PROMPTS[6][:9]]
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompts, n=2, stream=True, stream_options=options, **GREEDY
        )
    )
    *deltas, last = chunks
    lengths = [len(offline.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    seen = [0] * 4
    for c in deltas:
        (choice,) = c.choices
        seen[choice.index] += len(choice.model_extra["token_ids"])
        want = (lengths[choice.index // 2], seen[choice.index])
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == want
        assert c.usage.total_tokens == sum(want)
    assert seen == [6] * 4 and last.usage.completion_tokens == 24 and not last.choices
    messages = [{"role": "user", "content": "Hi"}]
    chat = list(
        client.chat.completions.create(
            model="tiny", messages=messages, stream=True, stream_options=options, **GREEDY
        )
    )
    assert [c.usage.completion_tokens for c in chat] == [0, 1, 2, 3, 4, 5, 6, 6]
    plain = client.completions.create(
        model="tiny",
        prompt=prompts[0],
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    assert [c.usage is None for c in plain] == [True] * 6 + [False]


def test_stop_strings_reach_the_engine(served):
    client = served.client()
    whole = client.completions.create(model="tiny", prompt=PROMPTS[3], **GREEDY).choices[0]
    stop = whole.text[2:4]
    cut = client.completions.create(model="tiny", prompt=PROMPTS[3], stop=[stop], **GREEDY)
    assert cut.choices[0].text == whole.text[: whole.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_a_stop_token_id_is_in_the_token_ids_but_not_the_text(served, offline):
    """vLLM's and SGLang's rule, as for EOS: the id that stopped the output is kept in its ids,
    its text is not in the answer's text, whole or streamed."""
    client = served.client()
    whole = client.completions.create(model="tiny", prompt=PROMPTS[4], **GREEDY).choices[0]
    ids = whole.model_extra["token_ids"]
    stop_id = next(t for t in ids[2:] if offline.tokenizer.decode([t]).strip())
    kept = ids[: ids.index(stop_id) + 1]
    body = dict(model="tiny", prompt=PROMPTS[4], temperature=0, max_tokens=6)
    extra = {"ignore_eos": True, "stop_token_ids": [stop_id]}
    cut = client.completions.create(**body, extra_body=extra).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["token_ids"] == kept
    assert cut.text == offline.tokenizer.decode(kept[:-1])
    chunks = list(client.completions.create(**body, extra_body=extra, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.text


def test_32_concurrent_requests_equal_offline_generate(served, offline):
    client = served.client()

    def ask(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, PROMPTS[:32]))
    assert got == [o.text for o in _offline(offline, PROMPTS[:32])]
    assert served.raw("GET", "/health")[1]["free_slots"] == SLOTS


@pytest.mark.parametrize(
    "body, status, words",
    [
        (dict(model="other", prompt="hi"), 404, "model 'other' does not exist"),
        (dict(prompt="hi", max_tokens=5000), 400, "maximum context length is 1024"),
        (dict(prompt="word " * 300), 400, "more than the 200 this server accepts"),
        (dict(prompt="hi", temperature=-1), 400, "temperature"),
        (dict(prompt="hi", n=2, best_of=1), 400, "best_of=1 must be an integer >= n=2"),
        (dict(prompt=""), 400, "prompt 0 is empty"),
        (dict(prompt=[[5, 999]]), 400, "outside the vocabulary"),
        (dict(prompt="hi", stop=[""]), 400, "stop strings must be non-empty"),
        (dict(prompt="x" * 5000), 413, "larger than --max-request-bytes"),
        (dict(max_tokens=3), 400, "prompt: Field required"),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_server_survives(served, body, status, words):
    code, reply = served.raw("POST", "/v1/completions", json.dumps(body).encode())
    assert code == status and words in reply["error"]["message"]
    assert set(reply["error"]) == {"message", "type", "code", "param"}
    assert served.client().completions.create(model="tiny", prompt="ok", **GREEDY).choices


def test_tiny_temperature_or_top_p_is_served_and_the_server_survives(served):
    greedy = served.client().completions.create(model="tiny", prompt="hi", **GREEDY)
    # min_p=1 keeps only the likeliest token: greedy at any temperature
    for extra in (
        dict(temperature=1e-39),
        dict(temperature=1.0, top_p=1e-300),
        dict(temperature=1.5, min_p=1.0, seed=4),
    ):
        body = dict(prompt="hi", max_tokens=6, ignore_eos=True, **extra)
        code, reply = served.raw("POST", "/v1/completions", json.dumps(body).encode())
        assert code == 200 and reply["choices"][0]["text"] == greedy.choices[0].text
    assert served.raw("GET", "/health")[0] == 200


def test_a_request_failing_in_a_step_gets_500_and_the_others_are_served(served, monkeypatch):
    def flaky(logits, spec):
        if spec.seed == 13:
            raise RuntimeError("injected sampling fault")
        return sample(logits, spec)

    monkeypatch.setattr(sampler_module, "sample", flaky)
    client = served.client()
    with ThreadPoolExecutor(4) as pool:
        good = [
            pool.submit(client.completions.create, model="tiny", prompt=p, **GREEDY)
            for p in PROMPTS[:3]
        ]
        bad = dict(prompt="hi", max_tokens=4, seed=13)
        code, reply = served.raw("POST", "/v1/completions", json.dumps(bad).encode())
        assert all(len(f.result().choices[0].token_ids) == 6 for f in good)
    assert code == 500 and reply["error"]["code"] == "request_failed"
    assert "injected sampling fault" in reply["error"]["message"]
    stream = client.completions.create(
        model="tiny", prompt="hi", max_tokens=4, seed=13, stream=True
    )
    with pytest.raises(openai.APIError, match="injected sampling fault"):
        list(stream)
    # with include_usage: the error event, then [DONE] alone (no usage after an error: vLLM's)
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps({**bad, **usage}), headers)
    events = [ln for ln in conn.getresponse().read().decode().splitlines() if ln]
    assert events[-1] == "data: [DONE]" and '"request_failed"' in events[-2], events
    assert not any('"usage"' in e for e in events), events
    assert served.raw("GET", "/health")[0] == 200
    assert client.completions.create(model="tiny", prompt="ok", **GREEDY).choices


@pytest.mark.parametrize(
    "field, value",
    [
        ("suffix", "end"),
        ("allowed_token_ids", [1]),
    ],
)
def test_a_completion_field_not_implemented_is_refused_by_name(served, field, value):
    code, reply = served.raw(
        "POST", "/v1/completions", json.dumps({"prompt": "hi", field: value}).encode()
    )
    assert code == 400 and reply["error"]["code"] == "unsupported_parameter"
    assert (
        reply["error"]["message"].startswith(f"{field}=")
        and "not supported" in reply["error"]["message"]
    )


@pytest.mark.parametrize(
    "extra",
    [
        dict(functions=[{"name": "f", "parameters": {}}]),  # OpenAI's older tools
        dict(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
    ],
)
def test_a_chat_field_not_implemented_is_refused_by_name(served, extra):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    code, reply = served.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    name = next(iter(extra))
    assert code == 400 and reply["error"]["code"] == "unsupported_parameter"
    assert name in reply["error"]["message"] and "supported" in reply["error"]["message"]


def test_fields_sent_at_values_that_change_nothing_are_served(served, offline):
    no_ops = dict(n=1, echo=False, presence_penalty=0, frequency_penalty=0.0, best_of=1)
    no_ops |= dict(logit_bias={}, response_format={"type": "text"}, user="u", not_openai=1)
    greedy = dict(temperature=0, max_tokens=6)
    body = no_ops | {"ignore_eos": True}
    reply = served.client().completions.create(model="tiny", prompt="hi", **greedy, extra_body=body)
    assert reply.choices[0].text == _offline(offline, ["hi"])[0].text


def test_malformed_json_and_bad_chat_messages_are_400(served):
    code, reply = served.raw("POST", "/v1/completions", b"{not json")
    assert code == 400 and reply["error"]["type"] == "invalid_request_error"
    assert "not valid JSON: Expecting property name" in reply["error"]["message"]
    assert "(at character 1)" in reply["error"]["message"] and reply["error"]["param"] is None
    with pytest.raises(openai.BadRequestError, match="messages"):
        served.client().chat.completions.create(model="tiny", messages=[])


def _metrics(served) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    conn.request("GET", "/metrics")  # open without the key, like /health
    resp = conn.getresponse()
    assert resp.status == 200
    families = text_string_to_metric_families(resp.read().decode())
    return {
        s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
        for family in families
        for s in family.samples
    }


def test_metrics_move_with_requests_and_parse_as_prometheus(served, offline, caplog):
    before = _metrics(served)
    client = served.client()
    with caplog.at_level(logging.INFO, logger="moe_overlap.server"):
        client.completions.create(model="tiny", prompt="one", **GREEDY)
        list(client.completions.create(model="tiny", prompt="two", stream=True, **GREEDY))
    after = _metrics(served)
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_overlap.server"]
    assert len(lines) == 2 and all("6 generated, finish length" in line for line in lines)
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew["moe_overlap_generation_tokens_total"] == 12
    assert grew["moe_overlap_prompt_tokens_total"] == sum(
        len(offline.tokenizer.encode(p, add_special_tokens=False)) for p in ("one", "two")
    )
    assert grew["moe_overlap_requests_finished_total{length}"] == 2
    assert grew["moe_overlap_time_to_first_token_seconds_count"] == 2
    assert grew["moe_overlap_inter_token_latency_seconds_count"] == 2 * 5
    assert grew["moe_overlap_e2e_request_latency_seconds_count"] == 2
    assert after["moe_overlap_engine_up"] == 1 and after["moe_overlap_requests_running"] == 0
    assert after["moe_overlap_ranks_healthy"] == 1
    assert after["moe_overlap_kv_slots_total"] == SLOTS
    # every page came back with its request; none was preempted in a pool sized for all
    assert after["moe_overlap_kv_pages_total"] > 0 and after["moe_overlap_kv_pages_used"] == 0
    assert after["moe_overlap_kv_cache_usage"] == 0 and after["moe_overlap_preemptions"] == 0
    # vLLM's names: every prompt token was looked up in the prefix cache
    assert grew["vllm:prefix_cache_queries_total"] == grew["moe_overlap_prompt_tokens_total"]
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["moe_overlap_overlap_mode_info{none}"] == 1
    assert grew["moe_overlap_forwards_total{none}"] == 12  # one at a time: 6 steps each
    code, version = served.raw("GET", "/version", key="")
    assert code == 200 and version["version"]
    code, schema = served.raw("GET", "/openapi.json", key="")
    assert code == 200 and "/v1/completions" in schema["paths"]


def test_wrong_or_missing_key_is_refused_but_health_is_open(served):
    with pytest.raises(openai.AuthenticationError):
        served.client(key="wrong").models.list()
    code, reply = served.raw("GET", "/v1/models", key="")
    assert code == 401 and reply["error"]["code"] == "invalid_api_key"
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    assert [m.id for m in served.client().models.list()] == ["tiny"]
    card = served.raw("GET", "/v1/models")[1]["data"][0]
    assert card["max_model_len"] == served.server.engine.llm.max_len
    assert served.client().models.retrieve("tiny").id == "tiny"  # OpenAI's retrieve
    with pytest.raises(openai.NotFoundError, match="model 'other/x' does not exist"):
        served.client().models.retrieve("other/x")


def test_disconnected_stream_frees_its_slot(served):
    stream = served.client().completions.create(
        model="tiny",
        prompt="Tell me",
        stream=True,
        temperature=0,
        max_tokens=1000,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream)), next(iter(stream))
    running = served.raw("GET", "/health")[1]
    assert running["running"] == 1 and running["free_pages"] < running["total_pages"]
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 5  # the whole answer would take far longer
    while (health := served.raw("GET", "/health")[1])["running"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert health["free_slots"] == SLOTS and health["waiting"] == 0


def test_client_gone_before_a_whole_answer_frees_its_slot(served):
    body = {"prompt": "Tell me", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    deadline = time.monotonic() + 5
    while served.raw("GET", "/health")[1]["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    conn.close()  # gone without reading the answer
    deadline = time.monotonic() + 5
    while (health := served.raw("GET", "/health")[1])["running"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert health["free_slots"] == SLOTS


def test_online_load_is_served_without_errors_and_timed(served):
    requests = workload_requests("uniform:5-40", 12, 3, CFG["vocab_size"], seed=0)
    lengths = [len(r.prompt) for r in requests]
    assert len(lengths) == 12 and all(5 <= n <= 40 for n in lengths)
    target = Target(f"http://127.0.0.1:{served.port}/v1", KEY)  # a /v1 suffix is allowed
    result = run_load(target, requests, rate=40.0, seed=0, max_concurrency=4)
    assert result.errors == 0 and result.output_tokens == 12 * 3  # counted from usage
    assert 0 < result.ttft_ms[0] <= result.ttft_ms[1] and 0 < result.itl_ms[0] <= result.itl_ms[1]
    assert result.tokens_per_s > 0 and result.rss_mib[0] > 0 and result.rss_mib[1] > 0
    summary = result.summary
    assert summary["total_input_tokens"] == sum(lengths) and summary["output_lens"] == [3] * 12
    assert summary["median_ttft_ms"] <= summary["p99_ttft_ms"]
    assert summary["mean_tpot_ms"] > 0 and len(summary["itls"]) == 12 * 2
    # a server not below this process (--base-url): its memory is not ours to report
    remote = Target(target.base_url, KEY, local=False)
    result = run_load(remote, requests[:2], rate=40.0, seed=0)
    assert result.errors == 0 and result.to_json()["rss_mib"] == [None, None]


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


@pytest.fixture(scope="module")
def served_ep2(model_dir):
    run = Running(LLM(model_dir, ep=2, overlap="tbo", max_num_seqs=SLOTS, timeout_s=10))
    yield run
    run.stop()


def test_ep2_with_two_batch_overlap_equals_offline_generate(served_ep2, offline):
    client = served_ep2.client()

    def ask(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, PROMPTS[:8]))
    assert got == [o.text for o in _offline(offline, PROMPTS[:8])]
    chunks = client.completions.create(model="tiny", prompt=PROMPTS[0], stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == got[0]


def test_dead_rank_gives_503_and_stops_the_server_naming_it(served_ep2):
    executor = served_ep2.server.engine.llm.executor
    stream = served_ep2.client().completions.create(
        model="tiny",
        prompt="Tell me",
        stream=True,
        temperature=0,
        max_tokens=1000,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    # stop rank 1 first, so the driver is surely waiting for its reply when it dies mid-answer
    os.kill(executor.procs[1].proc.pid, signal.SIGSTOP)
    time.sleep(0.5)
    executor.procs[1].proc.kill()
    with pytest.raises(openai.APIError, match="rank 1 died"):
        list(stream)
    code, reply = served_ep2.raw("POST", "/v1/completions", b'{"prompt": "hi"}')
    assert code == 503 and "rank 1 died" in reply["error"]["message"]
    served_ep2.thread.join(15)
    assert not served_ep2.thread.is_alive()
    assert isinstance(served_ep2.error, EngineStopped) and "rank 1 died" in str(served_ep2.error)
    assert all(p.proc.poll() is not None for p in executor.procs)


SERVE = (
    "import argparse, sys\n"
    "from moe_overlap.tools.serve_cli import add_serve_commands\n"
    "p = argparse.ArgumentParser()\n"
    "add_serve_commands(p.add_subparsers())\n"
    "args = p.parse_args(sys.argv[1:])\n"
    "try:\n"
    "    sys.exit(args.func(args))\n"
    "except KeyboardInterrupt:\n"  # as moe-overlap's main does
    "    sys.exit(130)\n"
)


def descendants(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    children = [int(p) for p in found.stdout.split()]
    return children + [d for c in children for d in descendants(c)]


def alive_after(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` alive after up to ``seconds`` (a rank fork server exits as its
    driver's socket closes)."""
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(pids)


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running or not yet reaped."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.parametrize("sig, ep", [(signal.SIGINT, 1)])  # SIGTERM at ep=2: test_server_hostile
def test_signal_stops_the_server_and_every_rank(model_dir, sig, ep):
    port = _free_port()
    cmd = [sys.executable, "-c", SERVE, "serve", "--model", str(model_dir), "--ep", str(ep)]
    proc = subprocess.Popen([*cmd, "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        rank_pids = descendants(proc.pid)
        assert len(rank_pids) == (ep + 1 if ep > 1 else 0)  # the ranks and their fork server
        os.kill(proc.pid, sig)
        assert proc.wait(30) in (130, 128 + signal.SIGTERM)
        assert "serving 'served" in proc.stderr.read()
        assert not alive_after(rank_pids, 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _parse(*argv: str):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_serve_commands(sub)
    add_bench_serve_command(sub)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--rates", "0"], "every rate must be a positive number"),
        (["--rates", "fast"], "must be comma-separated numbers"),
        (["--modes", "tbo1"], "needs 2 or more micro-batches"),
        (["--workload", "single-long:5000"], "exceeds the model's context of 1024"),
        (["--num-requests", "0"], "--num-requests=0 must be >= 1"),
        (["--duration", "0"], "--duration=0.0 must be a positive number"),
        (["--max-concurrency", "0"], "--max-concurrency=0 must be >= 1"),
        (["--percentile-metrics", "ttft,speed"], "choose from ttft,tpot,itl,e2el"),
        (["--metric-percentiles", "0"], r"comma-separated numbers in \(0, 100\]"),
        (["--base-url", "http://x:1", "--modes", "tbo"], "drop one of them"),
        (["--random-range-ratio", "1"], r"--random-range-ratio=1.0 must be in \[0, 1\)"),
        (["--random-input-len", "64"], "shapes --dataset-name random, but workload runs"),
        (["--prefix-repetition-num-prefixes", "0"], "--prefix-repetition-num-prefixes=0 must"),
        (
            ["--dataset-name", "random", "--random-input-len", "1000", "--random-output-len", "30"],
            r"--dataset-name random \(--random-input-len 1000.*exceeds the model's context",
        ),
        (["--base-url", "http://x:1", "--compare-prefix-caching"], "drop one of them"),
    ],
)
def test_bench_serve_arguments_fail_before_any_rank_starts(model_dir, extra, match):
    args = _parse("bench-serve", "--model", str(model_dir), *extra)
    with pytest.raises(ConfigError, match=match):
        args.func(args)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--port", "70000"], "--port=70000 must be in 0..65535"),
        (["--max-request-bytes", "0"], "--max-request-bytes=0 must be >= 1"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens=0 must be >= 1"),
        (["--api-key", " "], "--api-key must not be empty"),
        (["--header-timeout", "0"], "--header-timeout=0.0 must be > 0"),
        (["--max-stop-sequences", "-1"], "--max-stop-sequences=-1 must be > 0"),
    ],
)
def test_serve_arguments_fail_before_any_rank_starts(model_dir, extra, match, monkeypatch):
    def accepted(self):  # a server that started would serve until killed: fail instead
        raise AssertionError(f"serve {extra} was accepted and began to serve")

    monkeypatch.setattr(Server, "run", accepted)
    args = _parse("serve", "--model", str(model_dir), *extra)
    with pytest.raises(ConfigError, match=match):
        args.func(args)


def test_bench_serve_measures_a_server_it_did_not_start(served, tmp_path, capsys):
    out = tmp_path / "load.json"
    args = _parse(
        "bench-serve", "--base-url", f"http://127.0.0.1:{served.port}", "--api-key", KEY,
        "--vocab-size", str(CFG["vocab_size"]), "--workload", "uniform:5-20",
        "--num-prompts", "6", "--request-rate", "inf", "--max-concurrency", "3",
        "--output-len", "4", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--json", str(out),
    )  # fmt: skip
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "Successful requests:", "Mean TPOT (ms):",
                 "P50 E2EL (ms):", "P99 ITL (ms):"):  # fmt: skip
        assert line in printed
    [result] = json.loads(out.read_text())["results"]
    assert result["completed"] == 6 and result["total_output_tokens"] == 24
    assert result["request_throughput"] > 0 and result["max_concurrency"] == 3
    assert {"mean_e2el_ms", "p50_ttft_ms", "std_itl_ms", "ttfts", "input_lens"} <= set(result)
    with pytest.raises(ConfigError, match="give --vocab-size"):
        bad = _parse("bench-serve", "--base-url", f"http://127.0.0.1:{served.port}")
        bad.func(bad)
    # vLLM's dataset flags: two prefixes of 8 tokens, each prompt 4 of its own, 3 out
    args = _parse(
        "bench-serve", "--base-url", f"http://127.0.0.1:{served.port}", "--api-key", KEY,
        "--vocab-size", str(CFG["vocab_size"]), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "8", "--prefix-repetition-suffix-len", "4",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
        "--num-prompts", "4", "--request-rate", "inf", "--json", str(out),
    )  # fmt: skip
    assert args.func(args) == 0
    [result] = json.loads(out.read_text())["results"]
    assert result["input_lens"] == [12] * 4 and result["total_output_tokens"] == 12


def test_serve_refuses_torchrun(model_dir, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "x")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "1")
    args = _parse("serve", "--model", str(model_dir))
    with pytest.raises(ConfigError, match="does not run under torchrun"):
        args.func(args)
