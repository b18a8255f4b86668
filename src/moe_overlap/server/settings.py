"""The server's settings: each a field here, with its flag generated from it
(``tools/flags.py``), so a new server flag is one field in this class."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.args import setting

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


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
        "require 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise)",
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
        "largest request body accepted; larger ones get a 400",
        group="server",
    )
    max_prompt_tokens: int | None = setting(
        None,
        "longest prompt accepted, in tokens; longer ones get a 400 (default: the model's "
        "context less one)",
        parse=int,
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
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
