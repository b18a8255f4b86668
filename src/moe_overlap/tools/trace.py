"""Write recorded timelines as a Chrome/Perfetto trace and as a picture.

Input: for each mode, for each rank, the spans of one recorded forward (``timeline.Span``).
Tracks: one per micro-batch (computation) and one for communication (each all-to-all from its
launch to its completion). Span times are ``perf_counter`` seconds, one clock for all local ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_overlap.core.timeline import Span
from moe_overlap.core.tracks import (
    COMM,
    DECISION,
    SPLIT,
    TP_COMM,
    is_compute,
    is_wait,
    wait,
    waiter,
)

Recording = dict[str, list[list[Span]]]  # mode -> rank -> spans
# what ``--plot``'s suffix may be (matplotlib's Agg writers); a path without one is a PNG
PLOT_FORMATS = ("png", "svg", "svgz", "pdf", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")


def plot_format(path: str | Path) -> str | None:
    """The image format ``--plot PATH`` names by its suffix (png without one), or None."""
    suffix = Path(path).suffix.lower().removeprefix(".")
    return "png" if not suffix else suffix if suffix in PLOT_FORMATS else None


_COMPUTE_COLORS = ("tab:blue", "tab:green", "tab:purple", "tab:brown")  # never comm's orange


def _tracks(spans: list[Span]) -> list[str]:
    """The compute lanes (one per micro-batch, SBO's blocks apart) and the communication lane."""
    names = {s.track for s in spans if is_compute(s.track)}
    return sorted(names) + [COMM]


def _bars(spans: list[Span], track: str, origin: float) -> list[tuple[float, float]]:
    return [((s.start - origin) * 1e3, (s.end - s.start) * 1e3) for s in spans if s.track == track]


def write_chrome_trace(recording: Recording, path: str | Path) -> None:
    """One process per (mode, rank), one thread per track; open in chrome://tracing or Perfetto."""
    events: list[dict] = []
    pid = 0
    for mode, ranks in recording.items():
        origin = min((s.start for spans in ranks for s in spans), default=0.0)
        for rank, spans in enumerate(ranks):
            events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": pid,
                    "tid": 0,
                    "args": {"name": f"{mode} / rank {rank}"},
                }
            )
            # then the waits, the decisions (auto's carry the predicted times; a scheme that ran
            # no overlap says why) and each micro-batch's rows (zero-length marks)
            tracks = _tracks(spans) + sorted({s.track for s in spans} - set(_tracks(spans)))
            for tid, track in enumerate(tracks):
                label = {
                    COMM: "communication",
                    TP_COMM: "attention-TP collectives (blocking)",
                    DECISION: "overlap decision",
                    SPLIT: "micro-batch rows",
                }.get(track, f"compute {track}")
                label = f"{waiter(track)} blocked on a receive" if is_wait(track) else label
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": label},
                    }
                )
                for s in spans:
                    if s.track == track:
                        events.append(
                            {
                                "ph": "X",
                                "name": s.name,
                                "pid": pid,
                                "tid": tid,
                                "ts": (s.start - origin) * 1e6,
                                "dur": (s.end - s.start) * 1e6,
                            }
                        )
            pid += 1
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def plot_timelines(recording: Recording, path: str | Path, rank: int = 0) -> None:
    """One panel per mode (same time axis): a lane per micro-batch and one for communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(recording)
    fig, axes = plt.subplots(
        len(modes), 1, figsize=(11, 1.3 + 1.1 * len(modes) * 1.6), sharex=True, squeeze=False
    )
    longest = 0.0
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        spans = recording[mode][rank]
        origin = min((s.start for s in spans), default=0.0)
        tracks = _tracks(spans)
        for lane, track in enumerate(tracks):
            color = "tab:orange" if track == COMM else _COMPUTE_COLORS[lane % len(_COMPUTE_COLORS)]
            ax.broken_barh(
                _bars(spans, track, origin),
                (lane - 0.4, 0.8),
                facecolors=color,
                edgecolors="white",
                linewidth=0.3,
            )
            # where the micro-batch sat blocked on a receive, over its compute bar
            ax.broken_barh(_bars(spans, wait(track), origin), (lane - 0.4, 0.8), facecolors="0.85")
        end = max(((s.end - origin) * 1e3 for s in spans), default=0.0)
        longest = max(longest, end)
        ax.set_yticks(range(len(tracks)), tracks)
        ax.set_ylim(-0.6, len(tracks) - 0.4)
        ax.set_title(f"{mode}: one forward on rank {rank}, {end:.0f} ms", loc="left", fontsize=10)
        ax.invert_yaxis()
    axes[-1, 0].set_xlim(0, longest * 1.02)
    axes[-1, 0].set_xlabel(
        "ms since the forward began: a lane per micro-batch (grey where it waits for a receive), "
        "comm: each all-to-all from launch to completion"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=plot_format(path))  # at ``path`` itself, suffix or not
    plt.close(fig)


def write_outputs(
    console, recording: Recording, args, payload: dict, holds: str | None = None
) -> None:
    """What ``--json``, ``--trace`` and ``--plot`` ask for (the bench's and the plan's), each
    in its own folder made on demand, then where each went; ``holds``: which of several runs
    the trace and the plot draw (the JSON holds them all)."""
    outputs = (("results", args.json), ("trace", args.trace), ("timeline", args.plot))
    for _, path in outputs:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))
    if args.trace:
        write_chrome_trace(recording, args.trace)
    if args.plot:
        plot_timelines(recording, args.plot)
    for what, path in outputs:
        if path:
            which = f" ({holds}; --json holds every run)" if holds and what != "results" else ""
            console.print(f"{what}: {path}{which}")
