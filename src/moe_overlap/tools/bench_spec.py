"""``bench-engine --speculative-algorithm NGRAM``: greedy decode with speculative decoding
against plain decoding, on the same weights and prompts in the same run, with the acceptance
length. The prompts repeat a random phrase (a repetitive workload, where n-gram drafts find
matches; random-weight models also fall into loops of their own)."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from moe_overlap.engine.llm import LLM
from moe_overlap.engine.request import SamplingParams
from moe_overlap.engine.spec_config import SpeculativeArgs
from moe_overlap.engine.speculation import SpeculationStats

PHRASE = 8  # tokens of the phrase each prompt repeats


@dataclass
class SpecResult:
    batch: int  # sequences decoding at once
    tokens: int  # generated per run
    plain_tok_s: float
    spec_tok_s: float
    acceptance_length: float  # tokens per verification, the bonus included
    acceptance_rate: float  # accepted / draft tokens ("accepted")
    same_tokens: str  # sequences whose tokens equal plain decoding's, "k/n" ("same")

    @property
    def speedup(self) -> float:
        return self.spec_tok_s / self.plain_tok_s


def repetitive_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens, each a random phrase of its own repeated."""
    gen = torch.Generator().manual_seed(seed + 104729 * batch + length)
    phrases = torch.randint(2, vocab, (batch, PHRASE), generator=gen).tolist()
    return [(p * (length // PHRASE + 1))[:length] for p in phrases]


def speculative_args(args: argparse.Namespace) -> dict | None:
    """The speculative settings the command was given, as ``LLM`` keywords (None: none)."""
    given = {f.name: getattr(args, f.name) for f in fields(SpeculativeArgs)}
    return given if SpeculativeArgs(**given).speculative() is not None else None


def bench_speculative(
    model_dir: Path, args: argparse.Namespace, vocab: int
) -> tuple[Table, dict[str, Any]]:
    """The table of ``speculative_cases`` and their report for ``--json``."""
    title = (
        f"{Path(args.hf_config).stem}: speculative decoding against plain greedy decoding, one "
        f"process, {torch.get_num_threads()} threads, fp32, best of {args.repeats}; prompts of "
        f"{args.decode_prompt_len} tokens repeating a phrase, {args.new_tokens} new tokens each; "
        "accept len: tokens per verification (the bonus included), accepted: drafts accepted"
    )
    results = speculative_cases(model_dir, args, vocab)
    report = {
        "config": args.hf_config,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "torch": torch.__version__,
        "speculative": speculative_args(args),
        "cases": [asdict(r) | {"speedup": r.speedup} for r in results],
    }
    return speculative_table(results, title), report


def speculative_cases(model_dir: Path, args: argparse.Namespace, vocab: int) -> list[SpecResult]:
    """Each decode batch of ``args`` with and without its speculative settings, the runs
    alternating, the best of ``args.repeats``."""
    speculative = speculative_args(args) or {}
    results = []
    for batch in args.decode_batches:
        prompts = repetitive_prompts(batch, args.decode_prompt_len, vocab, args.seed)
        params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
        context = args.decode_prompt_len + args.new_tokens
        with (
            LLM(model_dir, max_model_len=context) as plain,
            LLM(model_dir, max_model_len=context, **speculative) as spec,
        ):
            times: dict[str, list[float]] = {"plain": [], "spec": []}
            outs: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for name, llm in (("plain", plain), ("spec", spec)):
                    start = time.perf_counter()
                    outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
                    times[name].append(time.perf_counter() - start)
            assert spec.scheduler.speculation is not None
            stats: SpeculationStats = spec.scheduler.speculation.stats
        tokens = batch * args.new_tokens
        same = sum(a == b for a, b in zip(outs["plain"], outs["spec"], strict=True))
        results.append(
            SpecResult(
                batch,
                tokens,
                tokens / min(times["plain"]),
                tokens / min(times["spec"]),
                stats.mean_acceptance_length,
                stats.accepted_tokens / max(stats.draft_tokens, 1),
                f"{same}/{batch}",
            )
        )
    return results


def speculative_table(results: list[SpecResult], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("batch", "plain tok/s", "spec tok/s", "speed-up", "accept len", "accepted", "same"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r.batch),
            f"{r.plain_tok_s:,.1f}",
            f"{r.spec_tok_s:,.1f}",
            f"{r.speedup:.2f}x",
            f"{r.acceptance_length:.2f}",
            f"{r.acceptance_rate:.0%}",
            r.same_tokens,
        )
    return table
