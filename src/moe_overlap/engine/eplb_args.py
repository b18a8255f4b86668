"""SGLang's EPLB settings (redundant experts, their placement, how a token picks a replica, and
the bench's routing skew), one field each, as ``engine/args.py`` holds the others; vLLM's
``--eplb-config`` JSON is read onto them (``engine/vllm_eplb.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from moe_overlap.core.eplb_placement import ALGORITHMS, AUTO, Algorithm, PlacementShape
from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.expert_location import (
    DISPATCH_ALGORITHMS,
    TRIVIAL,
    ExpertPlacement,
    make_placement,
)
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.engine.args import setting
from moe_overlap.engine.vllm_eplb import EPLB_CONFIG_KEYS, apply_eplb_config


@dataclass
class EplbArgs:
    """SGLang's EPLB flags: redundant experts and where each expert's replicas live."""

    ep_num_redundant_experts: int = setting(
        0,
        "EPLB: extra physical expert slots, E + R over the --ep ranks, each a replica of a "
        "logical expert (which ones: --init-expert-location)",
        group="eplb",
    )
    init_expert_location: str = setting(
        TRIVIAL,
        "EPLB: trivial (slot i holds expert i % E), a placement JSON "
        '({"physical_to_logical": [[expert per slot] per MoE layer]}, e.g. from '
        "`moe-overlap eplb-placement`), or a distribution JSON "
        '({"load": [[tokens per expert] per MoE layer]}) placed at start-up',
        metavar="trivial|FILE",
        group="eplb",
    )
    ep_dispatch_algorithm: str = setting(
        "static",
        "EPLB: which replica serves a token: static (the one nearest the sending rank) or "
        "dynamic (spread over the replicas, by token)",
        choices=DISPATCH_ALGORITHMS,
        group="eplb",
    )
    eplb_algorithm: str = setting(
        AUTO,
        "EPLB: the placement policy for a distribution given to --init-expert-location and for "
        "--enable-eplb's rebalances: "
        "deepseek (global), deepseek_hierarchical (expert groups first), or auto",
        choices=ALGORITHMS,
        group="eplb",
    )
    enable_eplb: bool = setting(
        False,
        "EPLB online: every --eplb-rebalance-num-iterations steps the EP ranks sum the routing "
        "they recorded, compute a new placement with --eplb-algorithm and move expert weights "
        "between them at a step boundary (needs pure expert parallelism, --ep >= 2)",
        group="eplb",
    )
    eplb_rebalance_num_iterations: int = setting(
        1000,
        "EPLB online: steps between rebalances; the routing of those steps is what the next "
        "placement balances (vLLM's --eplb-step-interval)",
        aliases=("--eplb-step-interval",),
        group="eplb",
    )
    eplb_rebalance_layers_per_chunk: int | None = setting(
        None,
        "EPLB online: MoE layers moved per step boundary; a rebalance then spreads over several "
        "steps, one chunk each (default: every layer at once)",
        parse=int,
        group="eplb",
    )
    eplb_window_size: int | None = setting(
        None,
        "EPLB online: only the routing of the last W steps before a rebalance counts toward its "
        "placement (vLLM's window_size; default: every step since the last rebalance)",
        parse=int,
        group="eplb",
    )
    eplb_config: str | None = setting(
        None,
        "vLLM's EPLB settings as JSON, read onto the flags above: "
        + ", ".join(f"{k} (--{v.replace('_', '-')})" for k, (v, _) in EPLB_CONFIG_KEYS.items())
        + "; log_balancedness, log_balancedness_interval, use_async and policy at vLLM's "
        "defaults. A flag set away from its default that disagrees is refused",
        metavar="JSON",
        group="eplb",
    )

    expert_skew: str | None = setting(
        None,
        "bias the routers so a few experts are hot, to show imbalance (random-weight routers "
        "route almost evenly): zipf:S gives the expert of rank r in each layer odds falling "
        "as 1/(r+1)**S (e.g. zipf:1.2)",
        metavar="zipf:S",
        group="eplb",
    )

    def __post_init__(self) -> None:
        parent: Any = getattr(super(), "__post_init__", None)  # the other settings' checks
        if parent is not None:
            parent()
        if self.eplb_config is not None:
            apply_eplb_config(self, self.eplb_config)

    def skew_exponent(self) -> float:
        """``--expert-skew``'s S (0.0: none)."""
        text = self.expert_skew
        if text is None:
            return 0.0
        kind, _, value = str(text).partition(":")
        try:
            exponent = float(value)
        except ValueError:
            exponent = -1.0
        if kind != "zipf" or not exponent >= 0 or exponent == float("inf"):
            raise ConfigError(f"--expert-skew={text!r}: want zipf:S with S >= 0, e.g. zipf:1.2")
        return exponent

    def check_online(self, cfg: ModelConfig, par: ParallelConfig) -> None:
        """Refuse ``--enable-eplb`` where experts cannot move, or its counts are bad."""
        every, chunk = self.eplb_rebalance_num_iterations, self.eplb_rebalance_layers_per_chunk
        if not is_int(every) or every < 1:
            raise ConfigError(f"--eplb-rebalance-num-iterations={every!r}: want an integer >= 1")
        for flag, value, unset in (
            ("--eplb-rebalance-layers-per-chunk", chunk, "to move every layer at once"),
            ("--eplb-window-size", self.eplb_window_size, "to count every step since the last"),
        ):
            if value is not None and (not is_int(value) or value < 1):
                raise ConfigError(
                    f"{flag}={value!r}: want an integer >= 1, or leave it out {unset}"
                )
        if self.enable_eplb and (par.ep < 2 or par.moe_tp > 1 or par.pp > 1 or par.replicas > 1):
            raise ConfigError(
                f"--enable-eplb moves whole experts between expert-parallel ranks: "
                f"{par.describe()} does not have them (want --ep N >= 2 equal to --tp or with "
                "--tp 1, --pp 1 and no DP replicas)"
            )

    def expert_placement(
        self, cfg: ModelConfig, par: ParallelConfig, emulate_peers: int = 0, mtp: bool = False
    ) -> ExpertPlacement | None:
        """The placement these flags ask for over ``par``'s EP ranks (None: E/ep experts
        each); ``mtp``: the MTP layers run too, and their MoE layers are placed as the
        model's."""
        self.check_online(cfg, par)
        placement = self._placement(cfg, par.ep, mtp)
        if placement is not None and emulate_peers:
            raise ConfigError("--emulate-peers runs without EPLB: drop its flags")
        return placement

    def _placement(self, cfg: ModelConfig, ep: int, mtp: bool) -> ExpertPlacement | None:
        redundant = self.ep_num_redundant_experts
        if not is_int(redundant) or redundant < 0:
            raise ConfigError(f"--ep-num-redundant-experts={redundant!r} must be an integer >= 0")
        groups = cfg.n_group if cfg.n_group > 1 else None
        shape = PlacementShape(cfg.num_experts, cfg.num_experts + redundant, ep, 1, groups)
        layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if mtp else 0)
        moe_layers = [i for i in range(layers) if cfg.is_moe_layer(i)]
        algorithm = cast(Algorithm, self.eplb_algorithm)
        location, dispatch = self.init_expert_location, self.ep_dispatch_algorithm
        return make_placement(moe_layers, shape, location, dispatch, algorithm, self.enable_eplb)
