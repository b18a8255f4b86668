"""``moe-overlap make-model``: a seeded random checkpoint in the Hub's layout, in bf16/fp32 or
in the Hub's block FP8 (``--quantize fp8``), with a small tokenizer."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.kv_budget import available_ram
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.engine.args import ModelArgs, setting
from moe_overlap.engine.kv_memory import weight_bytes
from moe_overlap.engine.tokenizer import MIN_VOCAB_SIZE, write_tokenizer
from moe_overlap.model.fp8_checkpoint import quantize_checkpoint
from moe_overlap.model.loader import build_model, save_checkpoint
from moe_overlap.model.quant_config import FP8, QUANTIZATIONS
from moe_overlap.tools.flags import add_fields

CHECKPOINT_FILES = ("config.json", "tokenizer.json")
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin")
HUB_BLOCK = "128,128"  # --fp8-block's default, the Hub's


def checkpoint_files(out: Path) -> list[str]:
    """The files of a checkpoint already in ``out`` (none where it is not a directory)."""
    if not out.is_dir():
        return []
    names = (p.name for p in out.iterdir())
    return sorted(n for n in names if n in CHECKPOINT_FILES or n.endswith(WEIGHT_SUFFIXES))


def check_out_dir(out: Path) -> None:
    """Refuse an ``--out`` that cannot be a directory (a file, or a path under one) before
    the weights are built."""
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file; give a directory (made if missing)")


def parse_block(text: str) -> tuple[int, int]:
    """``"128"`` or ``"128,128"`` -> ``(128, 128)`` (rows, columns of one FP8 scale)."""
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) == 1:
        sizes *= 2
    if len(sizes) != 2 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--fp8-block {text!r}: want e.g. 128 or 128,128")
    return sizes[0], sizes[1]


@dataclass
class MakeModelFlags:
    """``moe-overlap make-model``: how the weights are stored."""

    quantize: str | None = setting(
        None,
        "fp8: store the projection weights as float8_e4m3fn with a float32 weight_scale_inv "
        "per block, as the Hub's -FP8 checkpoints (embeddings, LM head, norms and routers "
        "stay unquantized); docs/fp8.md",
        choices=QUANTIZATIONS,
    )
    overwrite: bool = setting(
        False, "replace a checkpoint already in --out (else it is refused: nothing is lost)"
    )
    fp8_block: str = setting(
        HUB_BLOCK,
        "with --quantize fp8: rows,cols of one scale block (the Hub's 128,128); a tiny "
        "model's dims are far below 128, so its tests use e.g. 32",
        parse=parse_block,
        metavar="ROWS[,COLS]",
    )


def check_fits_in_ram(cfg: ModelConfig, source: str, free: int | None) -> None:
    """Refuse a model whose float32 weights (built whole in memory, then written) would not
    fit in half of ``free`` bytes (``MemAvailable``; None: not known, not checked), with what
    to cut, rather than let the machine swap or the kernel kill the process."""
    need = weight_bytes(cfg, ParallelConfig(), "float32")
    if free is not None and need > free // 2:
        raise ConfigError(
            f"--hf-config {source}: its random weights take about {need / 2**30:.1f} GiB in "
            f"float32, more than half of the {free / 2**30:.1f} GiB this machine has free; "
            "write a copy of the config with fewer num_hidden_layers (and experts) for a "
            "model this machine can hold"
        )


def cmd_make_model(args: argparse.Namespace) -> int:
    if args.quantize != FP8 and args.fp8_block != parse_block(HUB_BLOCK):
        block = ",".join(map(str, args.fp8_block))
        raise ConfigError(f"--fp8-block {block} needs --quantize fp8 (without it nothing is cut)")
    check_out_dir(Path(args.out))
    held = checkpoint_files(Path(args.out))
    if held and not args.overwrite:
        raise ConfigError(
            f"--out {args.out} holds a checkpoint already ({', '.join(held[:4])}); choose "
            "another directory, or add --overwrite to replace it with random weights"
        )
    cfg = ModelConfig.from_hf(args.hf_config)
    check_fits_in_ram(cfg, args.hf_config, available_ram())
    model = build_model(cfg, seed=args.seed, mtp=True)  # with its MTP layers, if it has any
    save_checkpoint(model, args.out)
    print(f"wrote {args.out}/config.json and {args.out}/model.safetensors")
    if args.quantize == FP8:
        count = quantize_checkpoint(args.out, args.fp8_block)
        print(f"quantized {count} weights to FP8 in blocks of {list(args.fp8_block)}")
    if cfg.vocab_size >= MIN_VOCAB_SIZE:
        write_tokenizer(args.out, cfg.vocab_size)
        print(f"wrote a {cfg.vocab_size}-token BPE tokenizer to {args.out}/tokenizer.json")
    else:
        print(f"no tokenizer: vocab_size={cfg.vocab_size} < {MIN_VOCAB_SIZE} (ids only)")
    return 0


def add_make_model_command(sub: argparse._SubParsersAction) -> None:
    make = sub.add_parser(
        "make-model",
        help="write a seeded random checkpoint for a config",
        description="Write config.json and model.safetensors (Hub layout), and a small BPE "
        "tokenizer with a chat template trained on text kept in the repo.",
    )
    add_fields(make, ModelArgs, only=("hf_config",), required=True)
    make.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    add_fields(make, ModelArgs, only=("seed",))
    add_fields(make, MakeModelFlags)
    make.set_defaults(func=cmd_make_model)
