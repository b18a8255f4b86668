"""A model's caches on its rank: the paged KV pool and the recurrent-state cache, sized by the
model's own layers and kept on its device in its dtype. The rank's model runner sizes its
caches here, and ``auto``'s calibration its scratch ones (``overlap/calibrate.py``).

With the MTP drafter (``runtime/mtp_drafter.py``) the pool holds the MTP layers' entries too,
as layers ``num_hidden_layers + i`` on the same pages and block table: a sequence's MTP keys
and values take its pages as it grows and go back with them, inside the engine's budget
(``core/engine_config.py: kv_bytes_per_token``), and a cached page carries them."""

from __future__ import annotations

from moe_overlap.core.kv_budget import DEFAULT_PAGE_SIZE
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.state_cache import StateCache
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.loader import model_placement


def kv_cache_for(
    model: MoeForCausalLM,
    num_slots: int,
    max_len: int,
    page_size: int = DEFAULT_PAGE_SIZE,
    num_pages: int | None = None,
    padding: int = 0,
    window_pages: int | None = None,
    mtp: bool = False,
) -> KVCache:
    """The KV pool of ``num_slots`` sequences of up to ``max_len`` tokens for ``model``'s layers
    (``num_pages`` of ``page_size`` tokens; None: every slot at ``max_len``), and ``padding``
    more slots and pages for a CUDA graph's padding rows; ``window_pages``: the sliding-window
    layers' pool (None: as many pages as the full layers'); ``mtp``: with the entries of the
    model's MTP layers (on the stage that holds them), after its own."""
    device, dtype = model_placement(model)
    entries = model.kv_entries()
    if mtp and model.mtp_layers:  # on the full pages (MiMo's sliding one reads its window)
        entries += [layer.attn.kv_entries() for layer in model.mtp_layers]
    return KVCache(
        len(entries),
        num_slots + padding,
        max_len,
        entries,
        dtype,
        device,
        page_size,
        None if num_pages is None else num_pages + padding,
        [model.cfg.window(i) for i in range(model.cfg.num_hidden_layers)],
        None if window_pages is None else window_pages + padding,
    )


def state_cache_for(model: MoeForCausalLM, num_slots: int, snapshots: int = 0) -> StateCache:
    """The linear-attention layers' conv and SSM states of ``num_slots`` sequences (empty for
    a model without such layers), and ``snapshots`` entries kept for prefix caching."""
    device, dtype = model_placement(model)
    return StateCache(model.state_shapes(), num_slots, dtype, device, snapshots)
