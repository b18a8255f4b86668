"""Print how many device operations (kernel launches on a GPU) a bf16 forward of a model issues
per layer, by operation, counted on CPU with the model on meta tensors
(``moe_overlap/tools/device_ops.py``): a decode step and a prompt, without overlap and with TBO
and SBO.

Usage: PYTHONPATH=src python scripts/device_ops.py CONFIG_JSON [--layers N] [--emulate-peers N]
       [--decode SEQS] [--prefill TOKENS] [--a2a-mode auto|normal|low_latency]
"""

import argparse
import dataclasses

import torch

from moe_overlap import ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.tools.device_ops import count_forward, meta_runner

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("config", help="a Hugging Face config.json")
parser.add_argument("--layers", type=int, help="keep only this many layers (default: all)")
parser.add_argument("--emulate-peers", type=int, default=0, help="rank 0 of ep=N (default 0)")
parser.add_argument("--decode", type=int, default=64, help="sequences in the decode step")
parser.add_argument("--prefill", type=int, default=512, help="tokens in the prompt")
parser.add_argument(
    "--a2a-mode", default="auto", help="with --emulate-peers: the dispatch (default auto)"
)
args = parser.parse_args()

cfg = ModelConfig.from_hf(args.config)
if args.layers:
    cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
seqs, tokens = args.decode, args.prefill
batches = {
    f"decode-{seqs}": ForwardBatch(
        torch.arange(seqs), list(range(seqs)), [500] * seqs, [1] * seqs, is_decode=[True] * seqs
    ),
    f"prefill-{tokens}": ForwardBatch(torch.arange(tokens) % cfg.vocab_size, [0], [0], [tokens]),
}
runner = meta_runner(cfg, max_len=max(tokens, 501) + 1, seqs=seqs, emulate_peers=args.emulate_peers)
layers = cfg.num_hidden_layers
for mode in ("none", "tbo", "sbo"):
    cap = max(seqs, tokens)  # low_latency: every batch fits
    overlap = OverlapConfig(
        mode, tbo_min_tokens=1, a2a_mode=args.a2a_mode, num_max_dispatch_tokens_per_rank=cap
    )
    for name, batch in batches.items():
        ops = count_forward(runner, batch, overlap)
        total = sum(ops.values())
        print(f"{name} overlap={mode}: {total} operations, {total / layers:.1f} per layer")
        if mode == "none":
            print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))
