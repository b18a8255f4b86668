"""SGLang's own benchmark client, ``python -m sglang.bench_serving --backend sglang`` (its
default: the native ``/generate`` with streaming), against a tiny model served by
``moe-overlap serve --ep 2`` with two-batch overlap.

Two runs: vLLM/SGLang's ``random-ids`` dataset (the load shape every report uses), then a
ShareGPT-format file written here, whose greedy completions must be exactly the offline
engine's for the same prompts. Run with ``make sglang-bench``, which installs the client in its
own environment (``.venv-sglang``); the interpreter is the first argument. Exits 1 on any
failed request or mismatch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from served import free_port, make_tiny_model, serve

from moe_overlap import LLM, SamplingParams

NEW_TOKENS, PROMPTS = 12, 16
QUESTIONS = [f"Question {i}: how do experts {w} tokens?" for i, w in
             enumerate(("route", "share", "drop", "merge") * 4)]  # fmt: skip


def bench(client: str, port: int, model: Path, out: Path, dataset: list[str]) -> dict:
    """One ``bench_serving`` run; its result line, with every request's details."""
    cmd = [client, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
           "--port", str(port), "--model", str(model), "--tokenizer", str(model),
           "--num-prompts", str(PROMPTS), "--output-file", str(out), "--output-details",
           *dataset]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # no Hub lookups: the tokenizer is local
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text().splitlines()[-1])


def sharegpt(where: Path) -> Path:
    rows = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": q}]}
            for q in QUESTIONS]  # fmt: skip
    where.write_text(json.dumps(rows))
    return where


def failures(result: dict, name: str) -> list[str]:
    wrong = [f"{name}: request failed: {e}" for e in result["errors"] if e]
    if result["completed"] != PROMPTS:
        wrong.append(f"{name}: {result['completed']} of {PROMPTS} requests completed")
    return wrong


def offline_texts(model: Path) -> Counter:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model) as llm:
        return Counter(out.text for out in llm.generate(QUESTIONS, params))


def main(client: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_tiny_model(model)
        port = free_port()
        server = serve(model, port)
        try:
            random_ids = ["--dataset-name", "random-ids", "--random-input-len", "32",
                          "--random-output-len", str(NEW_TOKENS), "--random-range-ratio", "1"]  # fmt: skip
            loaded = bench(client, port, model, Path(tmp) / "random.jsonl", random_ids)
            path = sharegpt(Path(tmp) / "sharegpt.json")
            share = ["--dataset-name", "sharegpt", "--dataset-path", str(path),
                     "--sharegpt-output-len", str(NEW_TOKENS)]  # fmt: skip
            greedy = bench(client, port, model, Path(tmp) / "sharegpt.jsonl", share)
        finally:
            server.terminate()
            server.wait(60)
        wrong = failures(loaded, "random-ids") + failures(greedy, "sharegpt")
        want, got = offline_texts(model), Counter(greedy["generated_texts"])
        if got != want:
            wrong.append(f"sharegpt texts differ from the offline engine's: {got - want}")
    print(f"sglang.bench_serving --backend sglang against serve --ep 2 (TBO): "
          f"{loaded['completed']} + {greedy['completed']} requests, "
          f"output {loaded['output_throughput']:.1f} tok/s on random-ids")  # fmt: skip
    for line in wrong:
        print("MISMATCH", line)
    print("every request served; greedy texts equal the offline engine's" if not wrong else
          f"{len(wrong)} problems")  # fmt: skip
    return 1 if wrong else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: sglang_bench_check.py PYTHON_WITH_SGLANG")
    sys.exit(main(sys.argv[1]))
