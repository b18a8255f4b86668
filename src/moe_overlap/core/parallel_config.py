"""The parallel layout a user asks for (SGLang's flags), and whether a model fits it.

``--tp N`` ranks form one tensor-parallel world. ``--dp D --enable-dp-attention`` cuts it into
``D`` attention-DP groups of ``tp / D`` ranks (attention TP), each with its own requests and KV
cache. ``--ep E`` shards the routed experts ``E`` ways inside the TP world; ``tp / E`` ranks
(moe-TP) share an expert, each holding a slice of its intermediate dimension. ``--tp 1 --ep E``
is pure expert parallelism: ``E`` ranks, each its own attention-DP group (attention TP 1).
``--dp D`` without ``--enable-dp-attention`` starts ``D`` independent replicas of that layout
(SGLang's data-parallel controller): no collective crosses replicas.
The group arithmetic is ``distributed/layout.py``'s; which combinations are legal, and which
models fit them, ``core/layout_rules.py: check_layout`` decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.errors import ConfigError, is_int


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    dp: int = 1
    ep: int = 1
    enable_dp_attention: bool = False
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "pp"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"--{name}={value!r} must be an integer >= 1")
        if not isinstance(self.enable_dp_attention, bool):
            raise ConfigError(
                f"enable_dp_attention={self.enable_dp_attention!r} must be true or false"
            )

    @property
    def pure_ep(self) -> bool:
        return self.tp == 1 and self.ep > 1

    @property
    def replicas(self) -> int:
        """Independent data-parallel replicas (``--dp`` without DP attention)."""
        return self.dp if self.dp > 1 and not self.enable_dp_attention and not self.pure_ep else 1

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: its TP world, or its EP ranks under pure EP."""
        return self.ep if self.pure_ep else self.tp

    @property
    def replica_size(self) -> int:
        return self.stage_size * self.pp

    @property
    def world_size(self) -> int:
        return self.replica_size * self.replicas

    @property
    def replica_attn_dp(self) -> int:
        if self.pure_ep:
            return self.ep
        return self.dp if self.enable_dp_attention else 1

    @property
    def attn_dp(self) -> int:
        """Attention-DP groups over every replica: the number of independent batches per step."""
        return self.replicas * self.replica_attn_dp

    @property
    def attn_tp(self) -> int:
        return self.stage_size // self.replica_attn_dp

    @property
    def moe_tp(self) -> int:
        return self.stage_size // self.ep

    def batch_of(self, rank: int) -> int:
        """Which attention-DP group's batch global ``rank`` runs (every stage runs it)."""
        replica, inside = divmod(rank, self.replica_size)
        return replica * self.replica_attn_dp + inside % self.stage_size // self.attn_tp

    def answers(self, rank: int) -> bool:
        """Whether ``rank`` returns its group's logits: attention-TP rank 0 of the last stage."""
        inside = rank % self.replica_size
        return inside // self.stage_size == self.pp - 1 and inside % self.attn_tp == 0

    def describe(self) -> str:
        if self.world_size == 1:
            return "one process"
        parts = [f"tp{self.tp}"] if not self.pure_ep else []
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.enable_dp_attention or self.pure_ep:
            parts.append(f"dp{self.replica_attn_dp} dp-attention")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        one = " ".join(parts) or "one process"
        return f"{self.replicas} replicas of {one}" if self.replicas > 1 else one


def pp_layers(num_layers: int, stage: int, stages: int) -> range:
    """Stage ``stage``'s contiguous layers (SGLang's ``get_pp_indices``): an even share, the
    remainder spread over the stages before the last (which also holds the norm and LM head)."""
    sizes = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):
        sizes[-i] += 1
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])
