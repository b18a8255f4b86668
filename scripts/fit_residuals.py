"""A saved `plan --calibration` file's fit: the fitted numbers, then per measured shape its wall
next to the plan of the same shape, and per pair the measured and planned walls.

Usage: python scripts/fit_residuals.py CONFIG CALIBRATION_JSON
"""

import json
import sys
from pathlib import Path

from moe_overlap.core.mode_labels import mode_config
from moe_overlap.planner.calibration import fit_cluster
from moe_overlap.planner.inputs import load_model_spec, make_layout
from moe_overlap.planner.measurements import TWO_PASSES, measurements_from_json
from moe_overlap.planner.plan import Planner

NAMES = ("op_overhead_us", "expert_overhead_us", "switch_overhead_us", "a2a_bytes_factor",
         "gemm_tflops_bf16", "attention_tflops", "kv_read_gbps", "seq_overhead_us",
         "decode_seq_overhead_us", "forward_overhead_us", "a2a_latency_us")  # fmt: skip

spec = load_model_spec(sys.argv[1])
raw = json.loads(Path(sys.argv[2]).read_text())
layout = make_layout(None, None, raw["ep"], False)
samples, passes = measurements_from_json(
    raw, spec.cfg.vocab_size, {k: raw[k] for k in raw if k not in ("samples", "passes")}
)
cluster = fit_cluster(spec, layout, samples, passes)
print({n: round(getattr(cluster, n), 4) for n in NAMES})
planner = Planner(spec, cluster, layout)
none = mode_config("none")
for s in samples:
    b = s.batch
    kind = "decode" if b.is_decode[0] else "prefill"
    shape = f"{kind} {b.num_seqs}x{b.extend_lens[0]}+{b.prefix_lens[0]}"
    plan = planner.plan("none", none, [b] * layout.world)
    error = (plan.seconds - s.wall_s) / s.wall_s
    print(f"{shape:22s} wall {s.wall_s * 1e3:8.1f} plan {plan.seconds * 1e3:8.1f} ({error:+.1%})")
for q in passes:
    pair = [q.batch] * layout.world
    planned = (
        planner.plan(m, c, pair).seconds for m, c in (("none", none), (q.mode, TWO_PASSES[q.mode]))
    )
    print(
        f"pair {q.mode} {q.batch.num_seqs} seqs: measured {q.none_s * 1e3:.1f} -> "
        f"{q.two_s * 1e3:.1f} ms, planned " + " -> ".join(f"{t * 1e3:.1f}" for t in planned)
    )
