"""Per mode and rank of a bench or plan trace: end, compute, waits and all-to-all time (ms).

Usage: python scripts/trace_summary.py TRACE_JSON...
"""

import json
import sys
from pathlib import Path

for path in sys.argv[1:]:
    events = json.loads(Path(path).read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }
    print(path)
    for pid, name in procs.items():
        xs = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        track = {id(e): threads[(pid, e["tid"])] for e in xs}
        total = {"compute": 0.0, "wait": 0.0, "comm": 0.0}
        for e in xs:
            t = track[id(e)]
            key = (
                "comm"
                if t == "communication"
                else "wait"
                if "wait" in t or "block" in t
                else "compute"
            )
            total[key] += e["dur"] / 1e3
        end = max(e["ts"] + e["dur"] for e in xs) / 1e3 - min(e["ts"] for e in xs) / 1e3
        print(f"  {name:28s} end {end:8.1f} " + " ".join(f"{k} {v:8.1f}" for k, v in total.items()))
