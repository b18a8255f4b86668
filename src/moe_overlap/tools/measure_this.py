"""``--cluster this``'s measuring run: the engine's ranks over ``--link`` run the shapes that
``planner/measurements.py`` names (no-overlap forwards in rounds, decode pairs with and without
two micro-batches), kept by ``plan --calibration PATH``; ``planner/calibration.py`` fits them."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from statistics import median

from moe_overlap.core import tracks
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.engine.llm import LLM
from moe_overlap.planner.calibration import fit_cluster
from moe_overlap.planner.cluster import Cluster
from moe_overlap.planner.inputs import ModelSpec, PlanLayout
from moe_overlap.planner.measurements import (
    PAIRS,
    TWO_PASSES,
    PassSample,
    Sample,
    calibration_batches,
    decode_batch,
    measurements_from_json,
    measurements_json,
    rank_batches,
)

_MB = re.compile(r"(\d+(?:\.\d+)?) MB")
_OUT_IN = re.compile(r"(\d+(?:\.\d+)?) out, (\d+(?:\.\d+)?) in\)")
PLAIN = mode_config(NONE.name)


def _timed(executor, batches, cfg, record: bool = False) -> tuple[float, list]:
    """Seconds of one forward, and its spans per rank (with ``record``)."""
    start = time.perf_counter()
    spans = executor.run(batches, cfg, record=record).spans
    return time.perf_counter() - start, spans


def _dispatch_bytes(spans) -> tuple:
    """Per dispatch (a MoE layer's), per rank: the bytes it sent off the rank and received,
    read from the dispatches' labels."""
    found = [
        [_OUT_IN.search(s.name) for s in rank_spans if s.name.startswith("dispatch")]
        for rank_spans in spans
    ]
    if not all(found) or not all(m for rank in found for m in rank):
        return ()  # no dispatch, or labels without bytes: nothing to learn
    return tuple(
        tuple((float(f[1]) * 1e6, float(f[2]) * 1e6) for f in layer)
        for layer in zip(*found, strict=True)
    )


def _rounds(executor, batches, rounds: int, pairs=()) -> tuple[list, list]:
    """``rounds`` rounds over every shape (its ranks' batches: no overlap, recorded) and every
    pair (``(mode, batches)``: no overlap, then two micro-batches, twice) in turn, so that a
    burst of load on this shared machine hits every shape alike. Per shape a ``Sample``
    (median wall and all-to-all time, its all-to-alls' bytes and seconds, its routing); per
    pair a ``PassSample``: the median wall without overlap, and with two micro-batches that
    plus the median of the differences between neighbouring runs (a burst of load lifts both
    runs of a difference alike)."""
    walls: list[list[float]] = [[] for _ in batches]
    comms: list[list[float]] = [[] for _ in batches]
    transfers: list[list] = [[] for _ in batches]
    routed: list[tuple] = [() for _ in batches]  # the same tokens every round: the same routing
    none: list[list[float]] = [[] for _ in pairs]
    extra: list[list[float]] = [[] for _ in pairs]
    for _ in range(rounds):
        for i, batch in enumerate(batches):
            wall, spans = _timed(executor, batch, PLAIN, record=True)
            walls[i].append(wall)
            comms[i].append(
                max(sum(s.end - s.start for s in r if s.track == tracks.COMM) for r in spans)
            )
            for s in spans[0]:
                found = _MB.search(s.name) if s.track == tracks.COMM else None
                if found:
                    transfers[i].append((float(found[1]) * 1e6, s.end - s.start))
            routed[i] = _dispatch_bytes(spans)
        for i, (mode, pair) in enumerate(pairs):
            for _ in range(2):
                none[i].append(_timed(executor, pair, PLAIN)[0])
                extra[i].append(_timed(executor, pair, TWO_PASSES[mode])[0] - none[i][-1])
    samples = [
        Sample(b[0], median(w), median(c), tuple(t), r)
        for b, w, c, t, r in zip(batches, walls, comms, transfers, routed, strict=True)
    ]
    passes = [
        PassSample(pair[0], median(n), median(n) + median(e), mode)
        for (mode, pair), n, e in zip(pairs, none, extra, strict=True)
    ]
    return samples, passes


def calibrate_this(
    spec: ModelSpec, layout: PlanLayout, link: str, repeat: int, saved: str | None = None
) -> Cluster:
    """This machine's ranks and link as a Cluster (a run of a few seconds per shape). With
    ``saved``: the measurements in that file if it exists, else measured and written there."""
    about = {"config": spec.name, "ep": layout.ep, "world": layout.world, "link": link}
    if saved and Path(saved).is_file():
        try:
            raw = json.loads(Path(saved).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"--calibration {saved}: not JSON ({exc}); remove it to measure again"
            ) from None
        samples, passes = measurements_from_json(raw, spec.cfg.vocab_size, about)
        return fit_cluster(spec, layout, samples, passes)
    samples, passes = measure_this(spec, layout, link, repeat)
    if saved:
        Path(saved).parent.mkdir(parents=True, exist_ok=True)
        Path(saved).write_text(json.dumps(measurements_json(samples, passes, about)))
    return fit_cluster(spec, layout, samples, passes)


def measure_this(
    spec: ModelSpec, layout: PlanLayout, link: str, repeat: int
) -> tuple[list[Sample], list[PassSample]]:
    """The calibration's measured forwards (``planner/calibration.py`` says which)."""
    batches = calibration_batches(spec.cfg.vocab_size)
    with LLM(
        config=spec.cfg,
        ep=layout.ep,
        link=link,
        max_num_seqs=max(b.num_seqs for b in batches),
        max_model_len=max(max(b.prefix_lens) + max(b.extend_lens) for b in batches) + 1,
    ) as llm:
        ex = llm.executor

        def on_ranks(batch):
            return rank_batches(batch, layout.world, spec.cfg.vocab_size)

        pairs = [(m, on_ranks(decode_batch(*shape))) for m, shape in PAIRS]
        # decode first: a long prefill widens the cache and slows decode reads
        decode = [on_ranks(b) for b in batches if all(b.is_decode)]
        prefill = [on_ranks(b) for b in batches if not all(b.is_decode)]
        for mode, pair in pairs:  # warm every path once
            ex.run(pair, TWO_PASSES[mode])
        for ranks in decode:
            ex.run(ranks, PLAIN)
        # decode steps and pairs are short: more rounds
        samples, passes = _rounds(ex, decode, 3 * (repeat + 1), pairs)
        for ranks in prefill:
            ex.run(ranks, PLAIN)
        samples += _rounds(ex, prefill, repeat)[0]
    return samples, passes
