"""A model directory's tokenizer: a small byte-level BPE trained offline on text kept in the repo
(``write_tokenizer``), loaded back with its chat template through ``transformers``."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.repo_files import CONFIGS
from moe_overlap.engine.request import InvalidRequestError

CORPUS = CONFIGS / "tokenizer-corpus.txt"
# ids 0, 1, 2 in this order; id 1 is the shipped configs' eos_token_id
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
EOS_TOKEN = "<|im_end|>"
# ChatML, as Qwen's models use it
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# every byte has a token, then the special tokens: the smallest vocabulary write_tokenizer makes
MIN_VOCAB_SIZE = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)


def write_tokenizer(
    path: str | Path, vocab_size: int, corpus: str | Path = CORPUS
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``corpus`` and save it, with
    the ChatML chat template, into the directory ``path`` (tokenizer.json and its config)."""
    bad = isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
    if bad or vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size={vocab_size!r} is too small for a byte-level tokenizer: it needs at "
            f"least {MIN_VOCAB_SIZE} tokens (256 bytes and {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    return fast


def load_tokenizer(
    path: str | Path | None, vocab_size: int, named: bool = False
) -> PreTrainedTokenizerFast | None:
    """The tokenizer saved in model directory ``path``, or None when it has none; ``named``
    (the caller asked for this directory's tokenizer): none there is refused."""
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        if named:
            raise ConfigError(f"tokenizer={str(path)!r} is no directory holding a tokenizer.json")
        return None
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}/tokenizer.json could not be loaded: {exc}") from None
    if len(tok) > vocab_size:
        raise ConfigError(
            f"{path}/tokenizer.json has {len(tok)} tokens, more than the model's "
            f"vocab_size={vocab_size}"
        )
    return tok


JINJA_CHARS = "{}\n"  # a template holds one of these; a file name, none


def with_chat_template(tok: PreTrainedTokenizerFast | None, template: str) -> None:
    """Use ``template`` (a file, or the Jinja template itself) as ``tok``'s chat template;
    one that does not render a conversation is refused now, not at the first chat."""
    if tok is None:
        raise ConfigError("--chat-template needs a model with a tokenizer (tokenizer.json)")
    if _is_file(template):
        text = Path(template).read_text()
    elif not any(c in template for c in JINJA_CHARS):  # vLLM's test: a path, not a template
        raise ConfigError(
            f"--chat-template {template!r}: no such file, and no Jinja template either; give "
            "the path of a template file, or the template itself"
        )
    else:
        text = template
    try:
        tok.chat_template = text
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except Exception as exc:  # jinja2's errors, the template's own raise_exception
        raise ConfigError(f"--chat-template does not render a conversation: {exc}") from None


def _is_file(name: str) -> bool:
    """Whether ``name`` names a file (a template itself may be too long to be a path)."""
    try:
        return Path(name).is_file()
    except OSError:  # ENAMETOOLONG: a template, not a file name
        return False


def encode_chat(
    tok: PreTrainedTokenizerFast,
    conversation: list[dict],
    generation_prompt: bool,
    continue_final: bool = False,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The conversation through the chat template as token ids, each message's text encoded as
    text: a special token's string written in a message stays characters (transformers'
    ``split_special_tokens``), so a user cannot write the template's role markers. A
    conversation with no such string is encoded whole, exactly as the template renders it.
    ``continue_final``: the last message is left open for the model to go on (no end of turn);
    ``tools`` and ``template_kwargs`` are the template's variables."""
    text = tok.apply_chat_template(
        conversation,
        tools=tools,
        add_generation_prompt=generation_prompt,
        continue_final_message=continue_final,
        tokenize=False,
        **(template_kwargs or {}),
    )
    specials = [s for s in tok.all_special_tokens if s]
    if not any(s in m["content"] for m in conversation for s in specials):
        return tok.encode(text, add_special_tokens=False)
    ids: list[int] = []
    at = 0
    for i, message in enumerate(conversation):
        content = message["content"]
        start = text.find(content, at) if content else -1
        if start < 0:
            if any(s in content for s in specials):
                raise InvalidRequestError(
                    f"messages.{i}.content holds a special token's text that the chat "
                    "template rewrote, so it cannot be kept as plain text",
                    f"messages.{i}.content",
                )
            continue
        ids += tok.encode(text[at:start], add_special_tokens=False)
        ids += tok(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        at = start + len(content)
    return ids + tok.encode(text[at:], add_special_tokens=False)
