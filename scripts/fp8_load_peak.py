"""Peak memory of loading an FP8 checkpoint: each variant (run dtype, ``--fp8-dequant-on-the-fly``)
builds the model in a fresh process, which reports its RSS before the load, its peak RSS
(``getrusage`` maxrss) after it and the bytes the loaded model holds. ``--src`` runs the same
variants against another checkout's ``src`` (e.g. main, to compare loaders) in the same run.

    python scripts/fp8_load_peak.py --hf-config configs/qwen3-moe-bench.json --out /tmp/fp8-bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, sys, torch
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.loader import build_model
path, dtype, fly = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] == "1"
cfg = ModelConfig.from_hf(f"{path}/config.json")
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
before = rss()
model = build_model(cfg, path, dtype=dtype, fp8_on_the_fly=fly)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
print(json.dumps(dict(before=before, peak=peak, held=held)))
"""
VARIANTS = [("float32", False), ("bfloat16", False), ("bfloat16", True)]
MIB = 2**20


def measure(src: Path, path: Path, dtype: str, on_the_fly: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    argv = [sys.executable, "-c", CHILD, str(path), dtype, "1" if on_the_fly else "0"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-config", help="make the FP8 checkpoint from this config first")
    parser.add_argument("--out", required=True, help="the FP8 checkpoint (made if absent)")
    parser.add_argument("--src", action="append", default=[], help="other checkouts' src")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1] / "src"
    out = Path(args.out)
    if not (out / "model.safetensors").is_file():
        make = ["make-model", "--hf-config", args.hf_config, "--out", str(out)]
        cli = [sys.executable, "-m", "moe_overlap.tools.cli", *make, "--quantize", "fp8"]
        subprocess.run(cli, env=dict(os.environ, PYTHONPATH=str(here)), check=True)
    file_mib = (out / "model.safetensors").stat().st_size / MIB
    print(f"{out}: {file_mib:.1f} MiB on disk")
    print(
        f"{'src':<28} {'dtype':<9} {'on-the-fly':<10} {'held MiB':>9} {'peak +MiB':>10} {'ratio':>6}"
    )
    for src in [here, *map(Path, args.src)]:
        for dtype, on_the_fly in VARIANTS:
            m = measure(src, out, dtype, on_the_fly)
            grow = (m["peak"] - m["before"]) / MIB
            held = m["held"] / MIB
            name = str(src)[-28:]
            print(
                f"{name:<28} {dtype:<9} {on_the_fly!s:<10} {held:>9.1f} {grow:>10.1f} {grow / held:>6.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
