"""``moe-overlap bench-engine``: the engine's own speed (one process, no overlap) against
Hugging Face ``transformers`` on the same weights, in the same run."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.workloads import check_fits
from moe_overlap.engine.args import ModelArgs
from moe_overlap.engine.llm import LLM
from moe_overlap.engine.request import SamplingParams
from moe_overlap.engine.spec_config import SpeculativeArgs
from moe_overlap.model.loader import build_model, save_checkpoint
from moe_overlap.tools.bench_spec import bench_speculative, speculative_args
from moe_overlap.tools.command_flags import BenchEngineFlags
from moe_overlap.tools.engine_profile import (
    Breakdown,
    breakdown_table,
    peak_matmul_gflops,
    profiled,
)
from moe_overlap.tools.flags import add_fields


@dataclass
class Case:
    """``batch`` prompts of ``prompt_len`` random tokens, each generating ``new_tokens``.

    A prefill case generates one token (the prompt's forward and its first sample), and counts
    prompt tokens; a decode case counts generated tokens."""

    name: str
    kind: str  # "prefill" or "decode"
    batch: int
    prompt_len: int
    new_tokens: int

    @property
    def tokens(self) -> int:
        return self.batch * (self.prompt_len if self.kind == "prefill" else self.new_tokens)

    @property
    def sequence_len(self) -> int:
        return self.prompt_len + self.new_tokens


@dataclass
class CaseResult:
    name: str
    kind: str
    tokens: int
    ours_s: float
    ours_tok_s: float
    hf_s: float | None = None
    hf_tok_s: float | None = None
    ratio: float | None = None  # ours / transformers in tokens/s
    same_tokens: str | None = None  # sequences whose greedy tokens agree, "k/n"
    ours_times: list[float] = field(default_factory=list)  # every repeat, seconds
    hf_times: list[float] = field(default_factory=list)
    ours_breakdown: Breakdown | None = None  # with --breakdown: the fastest profiled run
    hf_breakdown: Breakdown | None = None


def make_cases(args: argparse.Namespace) -> list[Case]:
    cases = [Case(f"prefill {b}x{n}", "prefill", b, n, 1) for b, n in args.prefill]
    cases += [
        Case(f"decode batch {b}", "decode", b, args.decode_prompt_len, args.new_tokens)
        for b in args.decode_batches
    ]
    return cases


def prompts_for(case: Case, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + case.batch * 7919 + case.prompt_len)
    return torch.randint(2, vocab, (case.batch, case.prompt_len), generator=gen)


def run_ours(llm: LLM, case: Case, prompts: torch.Tensor) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_new_tokens=case.new_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts.tolist(), params)]


def run_hf(hf, case: Case, prompts: torch.Tensor) -> list[list[int]]:
    n = case.new_tokens
    with torch.inference_mode():
        out = hf.generate(prompts, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1] :].tolist()


def timed(
    fn: Callable[[], list[list[int]]], clock: Callable[[], float] = time.perf_counter
) -> tuple[float, list[list[int]]]:
    start = clock()
    out = fn()
    return clock() - start, out


def load_hf(model_dir: Path):
    """transformers' model on our checkpoint; imported here: an optional, slow import."""
    transformers = importlib.import_module("transformers")
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # like ignore_eos: min_new_tokens would instead forbid EOS and pick another token
    model.generation_config.eos_token_id = None
    return model.eval()


def bench_case(
    case: Case,
    model_dir: Path,
    hf,
    vocab: int,
    seed: int,
    repeats: int,
    breakdown: bool = False,
    clock: Callable[[], float] = time.perf_counter,
):
    """Time ``case`` ``repeats`` times for each engine, alternating, on ``clock``; the best
    time counts (on a shared machine the slower runs measure the neighbours, not the engine).
    With ``breakdown``, ``repeats`` more runs of each engine under the profiler say where the
    time went."""
    prompts = prompts_for(case, vocab, seed)
    ours: list[float] = []
    theirs: list[float] = []
    ours_out: list[list[int]] = []
    hf_out: list[list[int]] = []
    # the engine's defaults (max_num_seqs, max_num_batched_tokens); only the context is sized
    with LLM(model_dir, max_model_len=case.sequence_len) as llm:
        for _ in range(repeats):
            t, ours_out = timed(lambda: run_ours(llm, case, prompts), clock)
            ours.append(t)
            if hf is not None:
                t, hf_out = timed(lambda: run_hf(hf, case, prompts), clock)
                theirs.append(t)
        ours_split = None
        if breakdown:
            ours_split = profiled(lambda: run_ours(llm, case, prompts), min(ours), repeats)
    hf_split = None
    if breakdown and hf is not None:
        hf_split = profiled(lambda: run_hf(hf, case, prompts), min(theirs), repeats)
    ours_s = min(ours)
    result = CaseResult(case.name, case.kind, case.tokens, ours_s, case.tokens / ours_s)
    result.ours_times, result.hf_times = ours, theirs
    result.ours_breakdown, result.hf_breakdown = ours_split, hf_split
    if hf is not None:
        result.hf_s = min(theirs)
        result.hf_tok_s = case.tokens / result.hf_s
        result.ratio = result.ours_tok_s / result.hf_tok_s
        same = sum(a == b for a, b in zip(ours_out, hf_out, strict=True))
        result.same_tokens = f"{same}/{len(ours_out)}"
    return result


def results_table(results: list[CaseResult], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("case", "tokens", "ours tok/s", "HF tok/s", "ours/HF", "same tokens"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in results:
        table.add_row(
            r.name,
            f"{r.tokens:,}",
            f"{r.ours_tok_s:,.0f}",
            "-" if r.hf_tok_s is None else f"{r.hf_tok_s:,.0f}",
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
            r.same_tokens or "-",
        )
    return table


def cmd_bench_engine(args: argparse.Namespace) -> int:
    counts = ("threads", "repeats", "new_tokens", "decode_prompt_len")
    bad = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in counts if getattr(args, n) < 1]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: must be >= 1")
    has_hf = importlib.util.find_spec("transformers") is not None
    if args.compare_hf and not has_hf:
        raise ConfigError("--compare-hf needs transformers (pip install transformers)")
    cfg = ModelConfig.from_hf(args.hf_config)
    cases = make_cases(args)
    longest = max(cases, key=lambda c: c.sequence_len)
    check_fits(f"case {longest.name}", longest.sequence_len, cfg)
    torch.set_num_threads(args.threads)
    console = Console()
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        save_checkpoint(build_model(cfg, seed=args.seed, mtp=True), tmp)  # both engines load these
        hf = load_hf(Path(tmp)) if args.compare_hf else None
        if speculative_args(args) is not None:
            table, report = bench_speculative(Path(tmp), args, cfg.vocab_size)
            console.print(table)
            write_report(args.json, report, console)
            return 0
        clock = time.process_time if args.cpu_time else time.perf_counter
        results = [
            bench_case(
                case, Path(tmp), hf, cfg.vocab_size, args.seed, args.repeats, args.breakdown, clock
            )
            for case in cases
        ]
    title = (
        f"{Path(args.hf_config).stem}, one process, {args.threads} threads, fp32, best of "
        f"{args.repeats}{', CPU time' if args.cpu_time else ''}; tokens/s: prompt tokens "
        "(prefill), generated tokens (decode)"
    )
    console.print(results_table(results, title))
    peak = peak_matmul_gflops() if args.breakdown else None
    if peak is not None:
        rows = [
            (r.name, engine, split)
            for r in results
            for engine, split in (("ours", r.ours_breakdown), ("HF", r.hf_breakdown))
            if split is not None
        ]
        console.print(breakdown_table(rows, peak, args.repeats))
    report = {
        "config": args.hf_config,
        "threads": args.threads,
        "cpu_time": args.cpu_time,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "matmul_peak_gflops": peak,
        "cases": [asdict(r) for r in results],
    }
    write_report(args.json, report, console)
    return 0


def write_report(path: str | None, report: dict, console: Console) -> None:
    """``--json PATH``: the report written there (nothing without the flag)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2))
        console.print(f"results: {path}")


def add_bench_engine_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-engine",
        help="time prefill and greedy decode, ours against transformers",
        description="Prefill (one long prompt; several short ones) and greedy decode at several "
        "batch sizes, one process without overlap, on seeded random weights; with "
        "--compare-hf, transformers runs the same weights and prompts in the same run.",
    )
    add_fields(p, ModelArgs, only=("hf_config",), required=True)
    add_fields(p, BenchEngineFlags)
    add_fields(p, ModelArgs, only=("seed",))
    add_fields(p, SpeculativeArgs)
    p.set_defaults(func=cmd_bench_engine)
