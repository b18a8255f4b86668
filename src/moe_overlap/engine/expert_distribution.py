"""SGLang's expert-distribution recorder, driver side: start and stop it on every rank, and
read what the ranks counted as tokens per (MoE layer, logical expert) and per EP rank. The
counts stay on the ranks' devices while recording; a read is one transfer per rank, asked for,
never per step."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.distributed.layout import layout_for
from moe_overlap.runtime.executor import Executor


@dataclass(frozen=True)
class ExpertDistribution:
    """Per MoE layer (``layers``): tokens routed to each logical expert (``load``, the
    distribution file ``eplb-placement`` and ``--init-expert-location`` take) and to each EP
    rank's slots (``rank_load``)."""

    layers: list[int]
    load: list[list[int]]
    rank_load: list[list[int]]

    @property
    def balancedness(self) -> list[float]:
        """Per layer, the mean rank load over the largest (1.0 when nothing was routed)."""
        return [sum(r) / len(r) / max(r) if max(r) else 1.0 for r in self.rank_load]

    def to_json(self) -> dict:
        return {
            "layers": self.layers,
            "load": self.load,
            "rank_load": self.rank_load,
            "balancedness": self.balancedness,
        }


def gather_distribution(
    per_rank: list[dict[int, list[int]] | None], spec: EngineSpec
) -> ExpertDistribution:
    """Sum the ranks' counts per physical slot (one rank per attention-TP group: its peers
    routed the same tokens), then fold the slots onto logical experts and onto EP ranks."""
    layout = layout_for(spec.parallel)
    slots: dict[int, list[int]] = {}
    for rank, counts in enumerate(per_rank):
        if counts is None or layout.coords(rank).attn_tp_rank != 0:
            continue
        for layer, row in counts.items():
            total = slots.setdefault(layer, [0] * len(row))
            slots[layer] = [a + b for a, b in zip(total, row, strict=True)]
    layers = sorted(slots)
    experts, ep = spec.config.num_experts, layout.ep
    load: list[list[int]] = []
    rank_load: list[list[int]] = []
    for layer in layers:
        holds = spec.placement.row(layer) if spec.placement else tuple(range(experts))
        logical, per_rank_load = [0] * experts, [0] * ep
        per = len(holds) // ep
        for slot, tokens in enumerate(slots[layer]):
            logical[holds[slot]] += tokens
            per_rank_load[slot // per] += tokens
        load.append(logical)
        rank_load.append(per_rank_load)
    return ExpertDistribution(layers, load, rank_load)


class ExpertRecorder:
    """``LLM``'s recorder methods (SGLang's names)."""

    executor: Executor
    spec: EngineSpec

    def start_expert_distribution_record(self) -> None:
        """Zero the counts on every rank and count each step's routing from now on."""
        self.executor.expert_load("start")

    def stop_expert_distribution_record(self) -> None:
        """Stop counting; what was counted stays readable."""
        self.executor.expert_load("stop")

    def expert_distribution(self) -> ExpertDistribution:
        """What the ranks counted since the last start."""
        return gather_distribution(self.executor.expert_load("read"), self.spec)
