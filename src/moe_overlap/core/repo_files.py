"""Where the files shipped beside the package live: ``configs/`` at the repository's root
(the tiny models' configs, the cluster presets, the tokenizer's corpus), read from a checkout
or an editable install."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
CONFIGS = REPO_ROOT / "configs"
