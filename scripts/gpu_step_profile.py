"""Time every engine step of a one-process run on a GPU, and profile one decode and one prefill
step with torch.profiler (host and kernel time side by side).

Usage: PYTHONPATH=src python scripts/gpu_step_profile.py CONFIG_JSON OUT_DIR [cuda|cpu]
Writes OUT_DIR/steps.txt (phase, kind, tokens, ms) and OUT_DIR/step-{decode,prefill}.txt.
"""

import sys
import time
from pathlib import Path

import torch

from moe_overlap import LLM, ModelConfig, SamplingParams

config, out = sys.argv[1], Path(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
out.mkdir(parents=True, exist_ok=True)
cfg = ModelConfig.from_hf(config)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(cfg.vocab_size, (512,), generator=gen).tolist() for _ in range(64)]
long_prompt = [torch.randint(cfg.vocab_size, (3072,), generator=gen).tolist()]
activities = [torch.profiler.ProfilerActivity.CPU]
if device == "cuda":
    activities.append(torch.profiler.ProfilerActivity.CUDA)
rows, profiled, phase = [], set(), ["warm-up"]

with LLM(config=cfg, device=device, dtype="bfloat16", max_num_seqs=64) as llm:
    step = llm.executor.step

    def timed(request):
        batches = request.batches
        kind = "decode" if all(all(b.is_decode) for b in batches) else "prefill"
        profile = phase[0] == "measured" and kind not in profiled and len(rows) > 12
        sync()
        start = time.perf_counter()
        if profile:
            profiled.add(kind)
            with torch.profiler.profile(activities=activities) as prof:
                reply = step(request)
                sync()
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
            (out / f"step-{kind}.txt").write_text(table)
        else:
            reply = step(request)
            sync()
        tokens = sum(b.input_ids.numel() for b in batches)
        rows.append((phase[0], kind, tokens, (time.perf_counter() - start) * 1e3, profile))
        return reply

    llm.executor.step = timed
    llm.generate(
        prompts + long_prompt, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    )
    phase[0] = "measured"
    llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    llm.generate(long_prompt, SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))

lines = [f"{p} {k} {t} tokens {ms:.1f} ms{' (profiled)' if f else ''}" for p, k, t, ms, f in rows]
(out / "steps.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
