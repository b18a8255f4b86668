"""``make demo``: a small MoE model on 2 expert-parallel ranks over an emulated link.

1. builds the default small model under out/model (once),
2. shows that 2 ranks with two-batch overlap generate exactly what one process does,
3. benchmarks every overlap mode on a mixed workload and writes out/bench.json,
   out/trace.json (open in Perfetto or chrome://tracing) and out/timeline.png,
4. over network namespaces, repeats the bench over the modelled link (out/bench-model.json).
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from moe_overlap import LLM, SamplingParams
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_modes import TBO
from moe_overlap.distributed.netns import LinkUnavailable, NetnsLink
from moe_overlap.model.loader import build_model, save_checkpoint
from moe_overlap.tools.cli import main as cli

CONFIG = Path("configs/qwen3-moe-bench.json")
OUT = Path("out")
RATE = os.environ.get("DEMO_RATE", "400mbit")  # where T_comm ~ T_comp for this model here
WORKLOAD = os.environ.get("DEMO_WORKLOAD", "uniform:30-3072:2048")


def pick_link(console: Console) -> str:
    try:
        with NetnsLink(2, RATE):
            pass
    except (LinkUnavailable, OSError) as exc:
        console.print(
            f"[yellow]network namespaces are not permitted here ({exc}); "
            f"using the modelled link instead[/]"
        )
        return f"model:{RATE},50us"
    console.print(f"link: each rank in its own network namespace, shaped to {RATE} by tc tbf")
    return f"netns:{RATE}"


def main() -> None:
    console = Console()
    model_dir = OUT / CONFIG.stem
    if not (model_dir / "model.safetensors").exists():
        save_checkpoint(build_model(ModelConfig.from_hf(CONFIG), seed=0), model_dir)
        console.print(f"built a random {CONFIG.stem} checkpoint in {model_dir}/")
    link = pick_link(console)

    prompts = [list(range(10, 60)), [5, 6, 7], list(range(100, 400))]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    with LLM(model_dir) as llm:
        alone = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(model_dir, ep=2, link=link, overlap=TBO.name) as llm:
        spread = [o.token_ids for o in llm.generate(prompts, params)]
    verdict = "identical" if alone == spread else "DIFFERENT (a bug: please report it)"
    console.print(f"greedy tokens, 1 process vs 2 ranks with two-batch overlap: {verdict}")

    bench(link, "bench", plots=True)
    if link.startswith("netns"):
        console.print(
            "\nThe same bench over the modelled link: the bytes go over loopback and each "
            "all-to-all completes no sooner than the link would allow, so no CPU is spent on "
            "emulating the wire (on 2 cores the shaped link's TCP path takes CPU from compute):"
        )
        bench(f"model:{RATE},50us", "bench-model", plots=False)


def bench(link: str, name: str, plots: bool) -> None:
    args = [
        "bench",
        "--model",
        str(OUT / CONFIG.stem),
        "--ep",
        "2",
        "--link",
        link,
        "--workload",
        WORKLOAD,
        "--repeat",
        "3",
        "--json",
        str(OUT / f"{name}.json"),
    ]
    if plots:
        args += ["--trace", str(OUT / "trace.json"), "--plot", str(OUT / "timeline.png")]
    cli(args)


if __name__ == "__main__":
    main()
