"""What every rank needs to build its shard of the engine (picklable, sent to each rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_overlap.core.device import rank_device, torch_dtype
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.expert_location import ExpertPlacement
from moe_overlap.core.kv_budget import (
    CPU_FALLBACK_BYTES,
    DEFAULT_PAGE_SIZE,
    STATE_SNAPSHOT_SHARE,
    mtp_rows_ahead,
    pages_for,
)
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.model_flops import linear_split
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig, pp_layers

DEFAULT_MAX_NUM_SEQS = 256  # sequences running at once per rank (vLLM's max_num_seqs)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # tokens per rank per forward (SGLang's chunked prefill)
# KV cache memory per rank where none is given (the engine sizes it: core/kv_budget.py)
DEFAULT_KV_CACHE_BYTES = CPU_FALLBACK_BYTES


def kv_bytes_per_token(
    cfg: ModelConfig,
    dtype_bytes: int = 4,
    attn_tp: int = 1,
    sliding: bool | None = None,
    mtp: bool = False,
    stage: range | None = None,
) -> int:
    """KV cache bytes one token takes on one rank over its pipeline stage's layers (``stage``;
    None: all of them), as the model's ``kv_entries`` holds them: MLA keeps its whole latent
    and rotated ``k_pe``, GQA the K and V heads of its attention-TP share, at least one; a
    linear-attention layer none: its state is per sequence. ``sliding`` True: over the
    sliding-window layers alone, False: over the others. ``mtp``: the MTP drafter's layers
    too, on the last stage, which the pool's pages hold beside the model's
    (``model/caches.py``), each whole-context (a sliding MTP layer's keys in the full pages)."""
    held = range(cfg.num_hidden_layers) if stage is None else stage
    layers = [
        i
        for i in held
        if not cfg.is_linear_layer(i) and (sliding is None or (cfg.window(i) > 0) == sliding)
    ]
    if mtp and not sliding and held.stop == cfg.num_hidden_layers:
        first = cfg.num_hidden_layers
        layers += range(first, first + cfg.num_nextn_predict_layers)
    if cfg.is_deepseek:
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * len(layers) * dtype_bytes
    width = cfg.head_size + cfg.value_head_size  # one K and one V head
    heads = sum(max(1, cfg.kv_heads(i) // attn_tp) for i in layers)
    return heads * width * dtype_bytes


def state_bytes(
    cfg: ModelConfig, dtype_bytes: int = 4, attn_tp: int = 1, stage: range | None = None
) -> int:
    """Bytes of one sequence's recurrent state over the linear-attention layers on one rank
    of pipeline stage ``stage`` (None: all layers; 0 without any): the conv state's last
    inputs in the run dtype, the SSM state in float32, for the rank's share of the heads
    (``model_flops.linear_split``)."""
    held = range(cfg.num_hidden_layers) if stage is None else stage
    layers = sum(cfg.is_linear_layer(i) for i in held)
    keys, values = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = (2 * keys + cfg.linear_num_value_heads * values) * (cfg.linear_conv_kernel_dim - 1)
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * values
    return layers * (conv * dtype_bytes + ssm * 4) // linear_split(cfg, attn_tp)


@dataclass(frozen=True)
class EngineSpec:
    """``max_num_seqs`` sequences at once at most (``num_slots``: rows of the block table);
    the KV cache budget in pages of ``page_size`` tokens (``pool_pages``) bounds how many of
    them fit, as they grow. Frozen: what ``__post_init__`` checked is what every rank runs."""

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
    page_size: int = DEFAULT_PAGE_SIZE  # tokens per KV page
    attention_backend: str = "torch_native"  # how decode reads the pages (ATTENTION_BACKENDS)
    max_total_tokens: int | None = None  # caps the pool's tokens below the budget (SGLang's)
    placement: ExpertPlacement | None = None  # EPLB's physical slots (None: E/ep experts each)
    expert_skew: float = 0.0  # --expert-skew zipf:S's S (0: the model's own routing)
    fp8_on_the_fly: bool = False  # an FP8 checkpoint's weights stay FP8, dequantized at use
    mtp_steps: int = 0  # --speculative-algorithm EAGLE: MTP drafts per sequence (0: off)
    verify_rows: int = 0  # speculative decoding: the rows a verify forward feeds a sequence
    prefix_caching: bool = False  # a hybrid model then keeps recurrent-state snapshots
    # sliding-window layers budgeted for their windows alone, their pages counted by the
    # scheduler (the engine's choice without PD-mux or speculation)
    sliding_budget: bool = False
    # --max-num-batched-tokens: a step's prefill chunks bound the sliding pages they hold
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # a clear error for an unknown name
        rank_device(self.device, 0)  # likewise
        if self.page_size < 1:
            raise ConfigError(f"--page-size={self.page_size} must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs={self.max_num_seqs} must be >= 1")
        if self.num_pages < pages_for(self.max_len, self.page_size):
            self._refuse_budget()

    def _refuse_budget(self) -> None:
        if self.state_total >= self.kv_cache_bytes:
            raise ConfigError(
                f"the recurrent states of --max-num-seqs={self.max_num_seqs} sequences "
                f"(and {self.state_snapshots} prefix-cache snapshots) take "
                f"{_size(self.state_total)}, all of the KV cache budget of "
                f"{_size(self.kv_cache_bytes)}; lower --max-num-seqs or raise the budget "
                "(--kv-cache-memory, --mem-fraction-static)"
            )
        cap = self.max_total_tokens  # what bounds the pool, as _pages applies it
        capped = cap is not None and self.num_pages == cap // self.page_size
        budget = (
            f"--max-total-tokens={self.max_total_tokens}"
            if capped
            else f"the KV cache budget of {_size(self.kv_cache_bytes)}"
        )
        raise ConfigError(
            f"{budget} ({self.num_pages} pages of {self.page_size} tokens) holds no "
            f"sequence of max_len={self.max_len} tokens ({_size(self.slot_bytes)} each); "
            "lower --max-model-len or raise the budget (--kv-cache-memory, "
            "--mem-fraction-static, --max-total-tokens)"
        )

    @property
    def slot_bytes(self) -> int:
        """KV cache bytes of one sequence at ``max_len`` tokens."""
        return self.token_bytes * self.max_len

    @property
    def num_slots(self) -> int:
        """Sequences per rank: ``max_num_seqs`` (the pages bound how many run at once)."""
        return self.max_num_seqs

    @property
    def token_bytes(self) -> int:
        """KV cache bytes of one token on a rank of the stage whose layers take the most (every
        stage's pool has the scheduler's pages, each for its own layers), MTP layers included."""
        return max(full + sliding for full, sliding in self._stage_bytes())

    def _stage_bytes(self) -> list[tuple[int, int]]:
        """Per pipeline stage: (full + MTP, sliding-window) layers' KV bytes of one token."""
        mtp, tp, cfg = self.mtp_steps > 0, self.parallel.attn_tp, self.config
        return [
            (kv_bytes_per_token(cfg, self._width, tp, False, mtp, stage),
             kv_bytes_per_token(cfg, self._width, tp, True, mtp, stage))
            for stage in self._stages
        ]  # fmt: skip

    @property
    def _stages(self) -> list[range]:
        layers, stages = self.config.num_hidden_layers, self.parallel.pp
        return [pp_layers(layers, s, stages) for s in range(stages)]

    @property
    def num_pages(self) -> int:
        """Pages of ``page_size`` tokens the budget holds (and ``max_total_tokens`` allows)."""
        return self._pages()[0]

    @property
    def window_pages(self) -> int:
        """The sliding-window layers' own pool: ``num_pages``, or what their windows need."""
        return self._pages()[1]

    @property
    def window_budget(self) -> tuple[int, int] | None:
        """(window tokens, the sliding layers' pool pages) where the scheduler counts that
        pool, else None."""
        if self.window_pages >= self.num_pages:
            return None
        return self.config.sliding_window, min(self.window_pages, self.pool_pages)

    def _pages(self) -> tuple[int, int]:
        """(pages, sliding-window pages) of the budget. Every page holds every layer's entries,
        unless ``sliding_budget``: then the sliding layers' pool holds what ``num_slots``
        sequences hold at once (each its window, a page more where the window's first key is
        partway into one, a page more for the end of a prefill chunk, and the step's chunks,
        ``max_num_batched_tokens``), and the rest of the budget goes to the full layers'
        pages."""
        avail, size = self.kv_cache_bytes - self.state_total, self.page_size
        page = self.token_bytes * size
        pages = window = avail // page
        sliding = max(s for _, s in self._stage_bytes()) * size
        if self.sliding_budget and 0 < sliding < page:
            span = pages_for(self.config.sliding_window, size) + 2
            chunks = pages_for(min(self.max_num_batched_tokens, self.max_len), size)
            window = min(pages, self.num_slots * span + chunks)
            if window < pages:  # else the windows may need every page: one pool for both
                pages = min(  # every stage: its full layers' pages beside its sliding windows
                    (avail - window * s * size) // (f * size) for f, s in self._stage_bytes() if f
                )
        if self.max_total_tokens is not None:
            pages = min(pages, self.max_total_tokens // size)
        return pages, min(window, pages)

    @property
    def state_total(self) -> int:
        """Bytes of a hybrid model's recurrent states: one per running sequence and, under
        speculative decoding, one after each row of its verify forward (kept until the next
        forward settles them; a bound on the kept conv window and SSM states), and the
        snapshots kept for prefix caching (0 without linear-attention layers)."""
        return (self.num_slots * (1 + self.verify_rows) + self.state_snapshots) * self._state_each

    @property
    def _state_each(self) -> int:
        """One sequence's recurrent state on a rank of the stage that holds the most."""
        tp = self.parallel.attn_tp
        return max(state_bytes(self.config, self._width, tp, stage) for stage in self._stages)

    @property
    def _width(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def state_snapshots(self) -> int:
        """Recurrent states a hybrid model keeps at cached page boundaries for prefix caching
        (``engine/prefix_states.py``): ``STATE_SNAPSHOT_SHARE`` of the KV budget, at most one
        a page; 0 without linear-attention layers or prefix caching."""
        each = self._state_each
        if not (self.prefix_caching and each):
            return 0
        pages = min(  # the most pages the pool could hold: more snapshots would never be used
            self.kv_cache_bytes // (self.token_bytes * self.page_size),
            self.num_slots * pages_for(self.max_len, self.page_size),
        )
        return min(int(self.kv_cache_bytes * STATE_SNAPSHOT_SHARE) // each, pages)

    @property
    def pool_pages(self) -> int:
        """The pages a rank's pool holds: ``num_pages``, or fewer where every sequence at
        ``max_len`` would not use them all."""
        return min(self.num_pages, self.num_slots * pages_for(self.max_len, self.page_size))

    def max_concurrent(self, tokens: int) -> int:
        """Sequences of ``tokens`` tokens the pages hold at once (at most ``max_num_seqs``),
        each decoding: under ``sliding_budget`` its sliding layers hold its window alone. The
        MTP drafter writes positions past each, in its pages (``mtp_rows_ahead``)."""
        ahead = mtp_rows_ahead(self.mtp_steps)
        need = pages_for(min(self.max_len, tokens + ahead), self.page_size)
        fits, budget = min(self.max_num_seqs, self.num_pages // need), self.window_budget
        if budget is None:
            return fits
        return min(fits, budget[1] // min(need, pages_for(budget[0], self.page_size) + 1))

    def kv_cache_summary(self) -> str:
        """One line for start-up: the pool's pages and tokens, the memory they take, and how
        many sequences they hold at once."""
        pages = self.pool_pages
        tokens, short = pages * self.page_size, min(1024, self.max_len)
        return (
            f"KV cache per rank: {pages} pages of {self.page_size} tokens = {tokens} tokens, "
            f"{_size(self._pool_bytes())} of {_size(self.kv_cache_bytes)}; "
            f"at once {self.max_concurrent(self.max_len)} sequences of max_len={self.max_len} "
            f"or {self.max_concurrent(short)} of {short} tokens (max_num_seqs={self.max_num_seqs})"
            + self._snapshot_summary()
            + self._window_summary()
        )

    def _pool_bytes(self) -> int:
        """Bytes of the largest stage's pools (its sliding layers' pages in a pool of their own)."""
        budget = self.window_budget
        window = self.pool_pages if budget is None else budget[1]
        pool = max(self.pool_pages * f + window * s for f, s in self._stage_bytes())
        return pool * self.page_size

    def _window_summary(self) -> str:
        budget = self.window_budget
        if budget is None:
            return ""
        return f"; sliding-window layers: {budget[1]} pages, for windows of {budget[0]} tokens"

    def _snapshot_summary(self) -> str:
        n, each = self.state_snapshots, self._state_each
        if not each:
            return ""
        return (
            f"; recurrent states of {each / 2**20:.2f} MiB: "
            f"{self.num_slots * (1 + self.verify_rows)} for the running sequences (and their "
            f"verify rows), {n} snapshots for prefix caching, {_size(self.state_total)}"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"  # small: tests, CPU
