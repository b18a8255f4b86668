"""The requests ``bench-serve`` sends: random token ids of the served vocabulary, their prompt
and answer lengths from one of three datasets.

- ``workload`` (ours): prompt lengths from the bench's workload grammar, every answer
  ``--output-len`` tokens.
- ``random`` (vLLM's ``bench serve --dataset-name random``): prompt and answer lengths drawn
  uniformly from ``len x [1 - ratio, 1 + ratio]``, after a shared prefix of ``prefix_len``
  tokens.
- ``prefix_repetition`` (vLLM's): ``num_prefixes`` prompts prefixes of ``prefix_len`` tokens,
  each request one of them (in turn) and a suffix of its own, so a prefix cache can hit.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.workloads import parse_workload

FIRST_ID = 3  # prompts avoid the shipped tokenizer's special tokens (ids 0-2)
DATASETS = ("workload", "random", "prefix_repetition")


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int


def prompt_lengths(workload: str, count: int, seed: int) -> list[int]:
    """``count`` prompt lengths drawn from a workload spec (``uniform:30-3072``, ...)."""
    lengths: list[int] = []
    draw = seed
    while len(lengths) < count:
        lengths += [n for rank in parse_workload(workload, 1, draw).lengths for n in rank]
        draw += 1
    return lengths[:count]


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def workload_requests(
    workload: str, count: int, output_len: int, vocab: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    lengths = prompt_lengths(workload, count, seed)
    return [BenchRequest(_ids(rng, n, vocab), output_len) for n in lengths]


def _around(rng: random.Random, length: int, ratio: float) -> int:
    return rng.randint(max(round(length * (1 - ratio)), 1), max(round(length * (1 + ratio)), 1))


def random_requests(
    count: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    vocab: int,
    seed: int,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    prefix = _ids(rng, prefix_len, vocab)
    return [
        BenchRequest(
            prefix + _ids(rng, _around(rng, input_len, range_ratio), vocab),
            _around(rng, output_len, range_ratio),
        )
        for _ in range(count)
    ]


def prefix_repetition_requests(
    count: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab: int,
    seed: int,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    return [
        BenchRequest(prefixes[i % num_prefixes] + _ids(rng, suffix_len, vocab), output_len)
        for i in range(count)
    ]


_DATASET_FLAGS = {"random": "random_", "prefix_repetition": "prefix_repetition_"}


def check_dataset_flags(args: argparse.Namespace, defaults: dict[str, object]) -> None:
    """A dataset's flags moved from their ``defaults`` while another dataset runs: refused,
    not silently ignored."""
    for dataset, prefix in _DATASET_FLAGS.items():
        if args.dataset_name == dataset:
            continue
        for name, default in defaults.items():
            if name.startswith(prefix) and getattr(args, name) != default:
                flag = f"--{name.replace('_', '-')}"
                raise ConfigError(
                    f"{flag} shapes --dataset-name {dataset}, but {args.dataset_name} runs: "
                    f"add --dataset-name {dataset}, or drop {flag}"
                )
