"""``make demo``: build the default small model and show it generating."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moe_overlap import LLM, SamplingParams
from moe_overlap.config import ModelConfig
from moe_overlap.model.loader import build_model, save_checkpoint

CONFIG = Path("configs/qwen3-moe-tiny.json")
MODEL_DIR = Path("out/model")


def main() -> None:
    console = Console()
    if not (MODEL_DIR / "model.safetensors").exists():
        save_checkpoint(build_model(ModelConfig.from_hf(CONFIG), seed=0), MODEL_DIR)
        console.print(f"built a random {CONFIG.stem} checkpoint in {MODEL_DIR}/")
    prompts = [[10, 20, 30, 40], [5, 6], list(range(100, 160))]
    with LLM(MODEL_DIR, max_num_batched_tokens=32) as llm:
        start = time.perf_counter()
        outs = llm.generate(
            prompts, SamplingParams(max_new_tokens=12, ignore_eos=True), progress=True
        )
        elapsed = time.perf_counter() - start
    table = Table(title=f"{CONFIG.stem}: greedy generation, one process")
    table.add_column("prompt tokens", justify="right")
    table.add_column("generated ids")
    for prompt, out in zip(prompts, outs, strict=True):
        table.add_row(str(len(prompt)), " ".join(map(str, out.token_ids)))
    console.print(table)
    console.print(f"{sum(len(o.token_ids) for o in outs)} tokens in {elapsed:.2f} s")


if __name__ == "__main__":
    main()
