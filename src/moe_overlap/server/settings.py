"""The server's settings: each a field here, with its flag generated from it
(``tools/flags.py``), so a new server flag is one field in this class."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.args import setting
from moe_overlap.server.reasoning import REASONING_PARSERS

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
TOOL_CALL_PARSERS = ("hermes",)
LIMITS = (  # the server's bounds, each > 0
    "max_prompts_per_request",
    "max_choices_per_request",
    "max_stop_sequences",
    "max_stop_chars",
    "header_timeout",
    "body_timeout",
    "max_connections",
    "max_connections_per_client",
    "max_buffered_bytes",
    "shutdown_timeout",
)


@dataclass
class ServerSettings:
    model_name: str = ""  # the model's id in the API; from --served-model-name or the source
    host: str = setting(
        "127.0.0.1",
        "address to bind (127.0.0.1: this machine only; 0.0.0.0 opens it to the network, so "
        "set --api-key too)",
        group="server",
    )
    port: int = setting(8000, "port to listen on", group="server")
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on every endpoint but /health, /metrics, /version, "
        "/docs and /openapi.json (401 otherwise)",
        metavar="KEY",
        group="server",
    )
    served_model_name: str | None = setting(
        None,
        "the model's id in the API (default: the model directory's or config's name)",
        metavar="NAME",
        group="server",
    )
    max_request_bytes: int = setting(
        DEFAULT_MAX_REQUEST_BYTES,
        "largest request body accepted; larger ones get a 413",
        group="server",
    )
    max_prompt_tokens: int | None = setting(
        None,
        "longest prompt accepted, in tokens; longer ones get a 400 (default: the model's "
        "context less one)",
        parse=int,
        group="server",
    )
    max_prompts_per_request: int = setting(
        64, "most prompts in one completions request (400 beyond)", group="server limits"
    )
    max_choices_per_request: int = setting(
        256,
        "most choices one request asks for: prompts x n, or prompts x best_of where larger; "
        "each is a request to the engine (400 beyond)",
        group="server limits",
    )
    max_stop_sequences: int = setting(
        4, "most stop strings in a request (OpenAI's limit; 400 beyond)", group="server limits"
    )
    max_stop_chars: int = setting(
        256, "longest stop string, in characters (400 beyond)", group="server limits"
    )
    header_timeout: float = setting(
        10.0,
        "seconds for a request's headers to arrive, from the connection or the last reply "
        "(the connection is closed after)",
        group="server limits",
    )
    body_timeout: float = setting(
        30.0, "seconds for a request's whole body once its headers are in (408 after)",
        group="server limits",
    )  # fmt: skip
    max_connections: int = setting(
        1024, "open connections at once; one more gets a 503 and is closed", group="server limits"
    )
    max_connections_per_client: int = setting(
        512,
        "open connections at once from one peer address, so one client cannot take all of "
        "--max-connections; one more gets a 503 and is closed before anything is read",
        group="server limits",
    )
    max_buffered_bytes: int = setting(
        256 << 20,
        "request body bytes received and not yet handled, all clients together (503 beyond)",
        group="server limits",
    )
    shutdown_timeout: float = setting(
        10.0,
        "seconds requests in flight may finish on SIGTERM/SIGINT before they are ended with "
        "an error (a second signal stops at once)",
        group="server limits",
    )
    metrics_record_every: int = setting(
        20,
        "record every Nth step's timeline on the ranks for /metrics' share of communication "
        "hidden (a recorded step costs a little more; 0: never)",
        group="server",
    )
    enable_auto_tool_choice: bool = setting(
        False,
        "serve chat's tool_choice='auto' (OpenAI's default with tools): the model answers "
        "freely and its calls are read back by --tool-call-parser (vLLM's flag; without it "
        "'auto' is refused, while named and 'required' calls always work)",
        group="server",
    )
    tool_call_parser: str | None = setting(
        None,
        'the call format --enable-auto-tool-choice reads: hermes, \'<tool_call>{"name": ..., '
        "\"arguments\": ...}</tool_call>' as Qwen2.5, Qwen3 and Qwen3-MoE's chat templates "
        "teach",
        choices=TOOL_CALL_PARSERS,
        group="server",
    )
    reasoning_parser: str | None = setting(
        None,
        "keep a thinking model's reasoning apart from its answer, in chat's reasoning_content "
        "(vLLM's and SGLang's flag): qwen3 (<think>...</think> opening the output), "
        "deepseek_r1 (all up to </think>, whose <think> the template opened)",
        choices=REASONING_PARSERS,
        group="server",
    )
    log_level: str = setting(
        "info",
        "log level of the server's loggers and uvicorn's (info: a line per finished request "
        "and a throughput line every 10 s while busy; warning: errors only)",
        choices=LOG_LEVELS,
        group="server",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port={self.port} must be in 0..65535")
        if self.max_request_bytes < 1:
            raise ConfigError(f"--max-request-bytes={self.max_request_bytes} must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens={self.max_prompt_tokens} must be >= 1")
        if self.metrics_record_every < 0:
            raise ConfigError(
                f"--metrics-record-every={self.metrics_record_every} must be >= 0 (0: never)"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError(
                "--enable-auto-tool-choice needs --tool-call-parser to read the model's calls "
                f"(one of {', '.join(TOOL_CALL_PARSERS)})"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        for name in LIMITS:
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)} must be > 0")

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser ``tool_choice='auto'`` uses, or None where it is refused."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None
