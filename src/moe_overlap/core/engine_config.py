"""What every rank needs to build its shard of the engine (picklable, sent to each rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_overlap.core.device import rank_device, torch_dtype
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig

DEFAULT_MAX_NUM_SEQS = 256  # sequences running at once per rank (vLLM's max_num_seqs)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # tokens per rank per forward (SGLang's chunked prefill)
# KV cache memory per rank, like vLLM's CPU KV cache space; it bounds the slots below
DEFAULT_KV_CACHE_BYTES = 4 * 2**30


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 4, attn_tp: int = 1) -> int:
    """KV cache bytes one token takes on one rank over all layers (the model's ``kv_entries``:
    MLA keeps its whole latent and rotated ``k_pe``, GQA the K and V heads of its attention-TP
    share, at least one)."""
    if cfg.is_deepseek:
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * dtype_bytes
    width = cfg.head_size + cfg.value_head_size  # one K and one V head
    heads = sum(max(1, cfg.kv_heads(i) // attn_tp) for i in range(cfg.num_hidden_layers))
    return heads * width * dtype_bytes


@dataclass
class EngineSpec:
    """``max_num_seqs`` asks for sequences at once; ``num_slots`` is what the KV cache budget
    allows at ``max_len`` tokens each, and what the cache and the scheduler use."""

    config: ModelConfig
    model_path: str | None = None
    seed: int = 0
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_len: int = 4096
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pdmux_splits: int = 0  # --enable-pdmux: layer ranges per prefill (0: off)
    emulate_peers: int = 0  # bench --emulate-peers: one process as rank 0 of ep=N (0: off)
    device: str = "cpu"  # "cpu" or "cuda" (core/device.py resolves "auto" before this)
    dtype: str = "float32"  # weights and KV cache; float32 is the exactness reference
    cuda_graph_max_bs: int = 0  # decode batches up to this size replay from CUDA graphs (0: off)

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # a clear error for an unknown name
        rank_device(self.device, 0)  # likewise
        if self.num_slots < 1:
            raise ConfigError(
                f"the KV cache budget of {_gib(self.kv_cache_bytes)} holds no sequence of "
                f"max_len={self.max_len} tokens ({_gib(self.slot_bytes)} each); lower "
                "--max-model-len or raise the budget"
            )

    @property
    def slot_bytes(self) -> int:
        """KV cache bytes of one sequence at ``max_len`` tokens."""
        width = torch_dtype(self.dtype).itemsize
        return kv_bytes_per_token(self.config, width, self.parallel.attn_tp) * self.max_len

    @property
    def num_slots(self) -> int:
        """Sequences per rank: ``max_num_seqs``, or fewer if the budget holds fewer."""
        return min(self.max_num_seqs, self.kv_cache_bytes // self.slot_bytes)

    def kv_cache_summary(self) -> str:
        """One line for start-up: slots, tokens each, and the memory they may take."""
        capped = " (capped by the KV cache budget)" if self.num_slots < self.max_num_seqs else ""
        return (
            f"KV cache per rank: {self.num_slots} sequences{capped} x {self.max_len} tokens, "
            f"up to {_gib(self.num_slots * self.slot_bytes)} of {_gib(self.kv_cache_bytes)}"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
