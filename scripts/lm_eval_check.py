"""lm-evaluation-harness (``lm_eval``, its ``local-completions`` model) as a real client of
``moe-overlap serve``: a log-likelihood task and a ``generate_until`` task from
``tests/data/lm_eval_tiny.jsonl``, against a tiny model served on two expert-parallel ranks
with two-batch overlap. Its log-likelihoods must equal the offline engine's log-probabilities
of the same token ids (fp32, 1e-4), and its generations the offline greedy text.

Run with ``make eval`` (which installs lm_eval); exits 1 on any mismatch.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from lm_eval import simple_evaluate
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager
from served import ROOT, free_port, make_tiny_model, serve

from moe_overlap import LLM, SamplingParams

DATA = ROOT / "tests" / "data" / "lm_eval_tiny.jsonl"
UNTIL, MAX_GEN = ["\n"], 6

TASKS = {
    "moe_tiny_loglik": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc"}],
    },
    "moe_tiny_generate": {
        "output_type": "generate_until",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{target}}",
        "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    },
}


def write_tasks(where: Path) -> None:
    for name, body in TASKS.items():
        task = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(DATA)}},
            "test_split": "test",
            **body,
        }
        (where / f"{name}.yaml").write_text(json.dumps(task))  # JSON is YAML


def check(lm: LocalCompletionsAPI, samples: dict, model: Path) -> list[str]:
    """Every mismatch between lm-eval's numbers and the offline engine's (and how many
    log-likelihoods and generations were compared)."""
    wrong, checked = [], [0, 0]
    with LLM(model) as llm:
        for s in samples["moe_tiny_loglik"]:
            for (context, continuation), resp in zip(s["arguments"], s["resps"], strict=True):
                got = float(resp[0][0])  # each response: [(log-likelihood, is_greedy)]
                ctx, cont = lm._encode_pair(context, continuation)
                scored = SamplingParams(max_new_tokens=0, prompt_logprobs=0)
                out = llm.generate([ctx + cont], scored)[0]
                want = sum(lp.logprob for lp in out.prompt_logprobs[len(ctx) :])
                checked[0] += 1
                if abs(got - want) > 1e-4:
                    wrong.append(f"loglik {context!r}+{continuation!r}: {got} vs {want}")
        for s in samples["moe_tiny_generate"]:
            context = s["arguments"][0][0]
            params = SamplingParams(temperature=0, max_new_tokens=MAX_GEN, stop=UNTIL)
            want = llm.generate([context], params)[0].text
            got = s["resps"][0][0]
            checked[1] += 1
            if got != want:
                wrong.append(f"generate {context!r}: {got!r} vs {want!r}")
    print(f"compared {checked[0]} log-likelihoods and {checked[1]} generations")
    return wrong


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model, tasks = Path(tmp) / "model", Path(tmp) / "tasks"
        tasks.mkdir()
        write_tasks(tasks)
        make_tiny_model(model)
        port = free_port()
        server = serve(model, port)
        try:
            lm = LocalCompletionsAPI(
                model="tiny",
                base_url=f"http://127.0.0.1:{port}/v1/completions",
                tokenizer=str(model),
                num_concurrent=1,
                max_retries=1,
            )
            results = simple_evaluate(
                model=lm,
                tasks=list(TASKS),
                task_manager=TaskManager(include_path=str(tasks)),
                log_samples=True,
            )
        finally:
            server.terminate()
            server.wait(60)
        wrong = check(lm, results["samples"], model)
    counts = {name: len(results["samples"][name]) for name in TASKS}
    print(f"lm-eval local-completions against serve --ep 2 (TBO): {counts} documents")
    for name in TASKS:
        print(f"  {name}: {results['results'][name]}")
    for line in wrong:
        print("MISMATCH", line)
    print("all equal to the offline engine" if not wrong else f"{len(wrong)} mismatches")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
