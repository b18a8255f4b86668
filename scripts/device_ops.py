"""Print how many device operations (kernel launches on a GPU) a bf16 forward of CONFIG issues
per layer, by operation, counted on CPU with the model on meta tensors
(``moe_overlap/tools/device_ops.py``).

Usage: PYTHONPATH=src python scripts/device_ops.py CONFIG_JSON [DECODE_BATCH] [PREFILL_TOKENS]
"""

import sys

import torch

from moe_overlap import ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.tools.device_ops import count_forward, meta_runner

cfg = ModelConfig.from_hf(sys.argv[1])
seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 64
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 512
batches = {
    f"decode-{seqs}": ForwardBatch(
        torch.arange(seqs), list(range(seqs)), [500] * seqs, [1] * seqs, is_decode=[True] * seqs
    ),
    f"prefill-{tokens}": ForwardBatch(torch.arange(tokens), [0], [0], [tokens]),
}
runner = meta_runner(cfg, max_len=max(tokens, 501) + 1, seqs=seqs)
layers = cfg.num_hidden_layers
for mode in ("none", "tbo"):
    overlap = OverlapConfig(mode, tbo_min_tokens=1) if mode != "none" else None
    for name, batch in batches.items():
        ops = count_forward(runner, batch, overlap)
        total = sum(ops.values())
        print(f"{name} overlap={mode}: {total} operations, {total / layers:.1f} per layer")
        if mode == "none":
            print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))
