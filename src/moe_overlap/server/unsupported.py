"""Every request field that vLLM's or SGLang's OpenAI-compatible server defines and this server
does not read as a protocol field (``server/protocol.py``'s models), and what happens to it:

- ``REFUSED``: a 400 that names the field, unless it holds a value that changes nothing (its
  default there), so no client (an evaluation harness asking for log-probabilities, say) gets a
  plain answer that silently ignored what it asked for;
- ``NO_OPS``: accepted and ignored, each with the reason that is harmless.

``tests/server/test_request_fields.py`` holds the anchors' field lists (written from their
protocol models) and checks each one is served, refused or a documented no-op. Fields no
engine defines are ignored, as vLLM ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping

OFF: tuple[object, ...] = (None, False)
NONE: tuple[object, ...] = (None,)
EMPTY: tuple[object, ...] = (None, [], {}, "")
ZERO: tuple[object, ...] = (None, 0)

# field -> (the values that change nothing, what is not supported)
_BOTH: dict[str, tuple[tuple, str]] = {
    "use_beam_search": (OFF, "beam search"),
    "length_penalty": ((None, 1, 1.0), "length_penalty (beam search)"),
    "include_stop_str_in_output": (OFF, "keeping the stop string in the output"),
    "skip_special_tokens": ((None, True), "detokenizing special tokens (they are skipped)"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens=false"),
    "truncate_prompt_tokens": (NONE, "prompt truncation"),
    "truncation_side": (NONE, "prompt truncation"),
    "allowed_token_ids": (NONE, "allowed_token_ids (use logit_bias)"),
    "bad_words": (EMPTY, "bad_words"),
    "logprob_token_ids": (NONE, "log-probabilities of chosen token ids"),
    "prompt_logprobs": (NONE, "prompt_logprobs (use echo with logprobs on completions)"),
    "logits_processors": (EMPTY, "custom logits processors"),
    "custom_logit_processor": (EMPTY, "custom logits processors"),
    "custom_params": (EMPTY, "custom logits processors' parameters"),
    "vllm_xargs": (EMPTY, "extension arguments"),
    "kv_transfer_params": (EMPTY, "disaggregated serving's KV transfer"),
    "ec_transfer_params": (EMPTY, "disaggregated serving's encoder-cache transfer"),
    "bootstrap_host": (NONE, "disaggregated serving (PD multiplexing runs in-process)"),
    "bootstrap_port": (NONE, "disaggregated serving (PD multiplexing runs in-process)"),
    "bootstrap_room": (NONE, "disaggregated serving (PD multiplexing runs in-process)"),
    "routed_dp_rank": (NONE, "choosing the data-parallel rank (the server balances)"),
    "data_parallel_rank": (NONE, "choosing the data-parallel rank (the server balances)"),
    "disagg_prefill_dp_rank": (NONE, "disaggregated serving"),
    "return_tokens_as_token_ids": (OFF, "tokens as token ids"),
    "return_token_offsets": (OFF, "token offsets"),
    "return_hidden_states": (OFF, "hidden states"),
    "return_routed_experts": (OFF, "the routed experts"),
    "routed_experts_start_len": (ZERO, "the routed experts"),
    "return_cached_tokens_details": (OFF, "cached-token details"),
    "return_prompt_token_ids": (OFF, "prompt token ids in the answer"),
    "return_meta_info": (OFF, "meta info in the answer"),
    "cache_salt": (EMPTY, "a salted prefix cache"),
    "priority": (ZERO, "priority scheduling"),
    "prompt_embeds": (EMPTY, "prompt embeddings"),
    "lora_path": (EMPTY, "LoRA adapters"),
    "session_id": (NONE, "sessions"),
    "session_params": (EMPTY, "sessions"),
    "stop_regex": (EMPTY, "stop_regex"),
    "no_stop_trim": (OFF, "no_stop_trim"),
    "ngram_corpus_id": (NONE, "an external n-gram corpus"),
    "images_config": (EMPTY, "images"),
    "repetition_detection": (NONE, "repetition detection"),
    "thinking_token_budget": ((None, -1), "a thinking token budget"),
    "max_repetition_pattern_size": (ZERO, "repetition detection"),
    "min_repetition_pattern_size": (ZERO, "repetition detection"),
    "repetition_min_count": (ZERO, "repetition detection"),
    "guided_whitespace_pattern": (NONE, "a whitespace pattern (JSON is compiled compact)"),
}
_COMPLETIONS: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "suffix (insertion)"),
}
_CHAT: dict[str, tuple[tuple, str]] = {
    "functions": ((None, []), "functions"),
    "function_call": ((None, "none", "auto"), "functions"),
    "audio": ((None,), "audio output"),
    "modalities": ((None, ["text"]), "output other than text"),
    "prediction": ((None,), "predicted outputs"),
    "echo": (OFF, "echo on chat (prepending the last message)"),
    "add_special_tokens": (OFF, "special tokens beyond the chat template's"),
    "documents": (EMPTY, "documents (RAG templates)"),
    "chat_template": (EMPTY, "a per-request chat template (serve --chat-template)"),
    "mm_processor_kwargs": (EMPTY, "multimodal processor arguments"),
    "reasoning_effort": (NONE, "reasoning effort"),
    "stream_reasoning": ((None, True), "holding streamed reasoning back to the end"),
    "input_ids": (EMPTY, "prompt token ids on chat (use /v1/completions)"),
    "task": (NONE, "quick-instruction tasks"),
    "max_dynamic_patch": (NONE, "images"),
    "min_dynamic_patch": (NONE, "images"),
    "use_audio_in_video": (OFF, "audio"),
}
# field -> why ignoring it is harmless
NO_OPS: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring; no effect on the answer",
    "request_id": "a client's id for the request; this server numbers requests itself",
    "rid": "a client's id for the request; this server numbers requests itself",
    "extra_key": "a client's classification key; nothing here is keyed by it",
    "custom_labels": "labels for the provider's metrics; no effect on the answer",
    "guided_decoding_backend": "xgrammar serves every constraint; the output obeys it either way",
}
REFUSED = {"completions": {**_BOTH, **_COMPLETIONS}, "chat": {**_BOTH, **_CHAT}}


def unsupported_field(body: Mapping, chat: bool) -> tuple[str, str] | None:
    """The first field of ``body`` this server cannot honour, and the message to refuse it
    with; None when every field can be served as asked."""
    for name, (no_ops, what) in REFUSED["chat" if chat else "completions"].items():
        if name in body and not any(_same(body[name], v) for v in no_ops):
            return name, f"{name}={body[name]!r:.60}: {what} is not supported by this server"
    messages = (body.get("messages") or []) if chat else []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                where = f"messages[{i}].content[{j}]"
                return where, f"{where}.type={kind!r}: only text parts are supported"
    return None


def _same(value: object, no_op: object) -> bool:
    if isinstance(no_op, bool) or isinstance(value, bool):
        return value is no_op
    return value == no_op
