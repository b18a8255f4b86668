"""A ``--model`` given as a Hugging Face Hub id (``Qwen/Qwen3-30B-A3B``) resolved to its
snapshot in the local Hugging Face cache, as vLLM and SGLang resolve it. Nothing is
downloaded here: a model missing from the cache is a ``ConfigError`` that says how to fetch it.
"""

from __future__ import annotations

import os
import re

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

from moe_overlap.core.errors import ConfigError

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model(model: str) -> str:
    """``model`` itself where it names a file or directory (or cannot be a Hub id); else the
    directory of that Hub id's snapshot in the local cache (``HF_HUB_CACHE``/``HF_HOME``)."""
    if os.path.exists(model) or not _HUB_ID.match(model):
        return model
    try:
        return snapshot_download(model, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"--model {model}: no such directory, and no snapshot of the Hub model {model!r} "
            f"in the local Hugging Face cache ({constants.HF_HUB_CACHE}). This engine "
            f"downloads nothing: fetch it first with `hf download {model}` (huggingface_hub's "
            "CLI; `huggingface-cli download` on older versions), or give the checkpoint's "
            "directory"
        ) from None
