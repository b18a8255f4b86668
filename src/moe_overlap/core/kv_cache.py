"""A paged KV cache: a pool of fixed-size pages and a block table from each slot to its pages.

A running sequence owns one slot (a row of the block table, as vLLM's block table and SGLang's
``req_to_token`` are); its tokens live in pages taken from the pool as it grows
(``reserve``, from the host's metadata before a forward) and given back when it ends
(``release``). Page 0 is never handed out: unused entries of the table point at it, so a
gather past a sequence's end reads zeros, to be masked.

Prefix caching (``apply``): the driver names full, computed pages; a named page outlives the
sequence that wrote it, and a later sequence's first table entries point at it, until the
driver evicts it. A sequence never writes a page it was attached to: its writes start past them.

Sliding-window layers (GPT-OSS, MiMo) have a block table and a pool of their own
(``core/window_table.py``), by default as many pages as the full layers' (a slot's window pages
are a subset of its full pages, so they never run out first), or ``window_pages`` where the
scheduler counts them (then the budget holds more full pages): before each forward,
``trim_windows`` returns the pages wholly below every sequence's window, so those layers'
buffers hold only the windows. A cached page keeps its window page until the driver gives it
back (``PageOps.unwindow``) or evicts the page, since a later request may cut its prefix there
and read the window before the cut.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from moe_overlap.core.kv_budget import DEFAULT_PAGE_SIZE, pages_for
from moe_overlap.core.step import PageOps
from moe_overlap.core.window_table import NULL_PAGE, WindowTable


class KVPoolExhausted(RuntimeError):
    """The pool has no free page for a sequence that grows (the scheduler admits by pages,
    so this means its count and the rank's disagree)."""


class KVCache:
    """Per layer, named page buffers of shape ``[pages, page_size, *entry_shape]`` (the same
    entries in every layer, or each layer's own), shared by ``num_slots`` sequences of at most
    ``max_len`` tokens through one block table.

    GQA stores ``k`` and ``v``; MLA stores its compressed ``latent`` and rotated ``k_pe``.
    The buffers grow (zero-filled) to the highest page handed out, so memory follows the
    sequences actually running, never more than ``num_pages`` pages.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        entries: dict[str, tuple[int, ...]] | Sequence[dict[str, tuple[int, ...]]],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int = DEFAULT_PAGE_SIZE,
        num_pages: int | None = None,
        windows: Sequence[int] = (),
        window_pages: int | None = None,
    ):
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = torch.device(device)  # where a forward's index tensors must live
        self.dtype = dtype
        self.page_size = page_size
        # --attention-backend flex_attention: decode attention reads the pages where they lie
        # (model/flex_decode.py) rather than through ``gather``
        self.read_in_place = False
        self.pages_per_seq = pages_for(max_len, page_size)
        # the pool: by default every slot at max_len (what whole-context slots would hold)
        self.num_pages = num_slots * self.pages_per_seq if num_pages is None else num_pages
        # PD multiplexing stores from two threads: a buffer may grow (be replaced) under one
        # while the other writes, so writes, growth and the table take turns
        self._lock = threading.Lock()
        # one dict: every layer's entries; a sequence: each layer's own (MiMo's sliding layers
        # have more KV heads than its full ones)
        per_layer = [entries] * num_layers if isinstance(entries, dict) else list(entries)
        self.layers = [
            {
                name: torch.zeros(1, page_size, *shape, dtype=dtype, device=device)
                for name, shape in layer.items()
            }
            for layer in per_layer
        ]
        self.block_table = torch.zeros(
            num_slots, self.pages_per_seq, dtype=torch.long, device=self.device
        )
        self.held: list[list[int]] = [[] for _ in range(num_slots)]  # the host's copy, by slot
        self.free = list(range(self.num_pages, NULL_PAGE, -1))  # popped lowest first
        self.cached: dict[int, int] = {}  # prefix caching: a cached page's id -> its page
        self.cached_pages: set[int] = set()
        # per layer: its sliding window (0: full attention); the window layers' own table
        self.sliding = [w > 0 for w in windows] + [False] * (num_layers - len(windows))
        self.window = max(windows, default=0)
        total = self.num_pages if window_pages is None else window_pages
        self.windows = WindowTable(
            num_slots, self.pages_per_seq, total, self.window, page_size, self.device
        )

    @property
    def free_pages(self) -> int:
        return len(self.free)

    @property
    def window_pages_used(self) -> int:
        """Pages the sliding-window layers hold now (0 without such layers)."""
        return self.windows.used if self.window else 0

    def reserve(self, slots: Sequence[int], ends: Sequence[int]) -> None:
        """Pages for tokens ``[0, ends[i])`` of ``slots[i]``, taken from the pool where the
        slot holds fewer (a slot keeps its pages, and their contents, until released)."""
        with self._lock:
            for slot, end in zip(slots, ends, strict=True):
                self._check(end, slot + 1)
                held, need = self.held[slot], pages_for(end, self.page_size)
                if need <= len(held):
                    continue
                if need - len(held) > len(self.free):
                    raise KVPoolExhausted(
                        f"slot {slot} needs {need - len(held)} more KV pages for {end} tokens; "
                        f"{len(self.free)} of {self.num_pages} are free"
                    )
                new = [self.free.pop() for _ in range(need - len(held))]
                self.block_table[slot, len(held) : need] = torch.tensor(new)
                held.extend(new)
                self._grow(max(new) + 1, sliding=False)
                window = self.windows.reserve(slot, need) if self.window else []
                if window:
                    self._grow(max(window) + 1, sliding=True)

    def trim_windows(self, slots: Sequence[int], starts: Sequence[int]) -> None:
        """Before a forward whose sequence ``slots[i]`` computes from position ``starts[i]``:
        its sliding-window layers' pages wholly below the window of that first query leave its
        table (its own back to their pool; a cached page's stays the cache's until the driver
        gives it back). A no-op without sliding-window layers."""
        if self.window:
            with self._lock:
                self.windows.trim(slots, starts, self.held, self.cached_pages)

    def release(self, slots: Sequence[int]) -> None:
        """Give the pages of ``slots`` (sequences that ended) back to the pool, but for cached
        ones, which stay until evicted."""
        with self._lock:
            for slot in slots:
                own = [p for p in self.held[slot] if p not in self.cached_pages]
                self.free.extend(reversed(own))
                self.windows.release(slot, self.held[slot], self.cached_pages)
                self.held[slot] = []
                self.block_table[slot].fill_(NULL_PAGE)

    def apply(self, ops: PageOps) -> None:
        """The driver's page changes for this step, in ``PageOps``' order: cache full pages,
        release ended slots, evict cached pages, give back cached pages' window pages, attach
        cached pages to new slots."""
        with self._lock:
            for slot, index, page_id in ops.publish:
                page = self.held[slot][index]
                self.cached[page_id] = page
                self.cached_pages.add(page)
                if self.window:
                    self.windows.cache(slot, index, page_id)
        self.release(ops.released)
        with self._lock:
            for page_id in [*ops.evict, *ops.unwindow]:
                self.windows.drop(page_id)
            for page_id in ops.evict:
                page = self.cached.pop(page_id)
                self.cached_pages.discard(page)
                self.free.append(page)
            for slot, ids in ops.attach:
                if self.held[slot]:
                    raise RuntimeError(f"cached pages attached to slot {slot}, which holds pages")
                pages = [self.cached[i] for i in ids]
                self.held[slot] = pages
                self.block_table[slot, : len(pages)] = torch.tensor(pages)
                if self.window:
                    self.windows.attach(slot, ids)

    def store(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        bounds: tuple[int, int] | None = None,
        pages: dict | None = None,
        **new: torch.Tensor,
    ) -> None:
        """Write each new token's entries at ``(slots[i], positions[i])`` (one call per entry),
        in the pages ``reserve`` gave those positions. ``bounds``: (the highest position, the
        highest slot) + 1, from the host's metadata; the forward passes them, since reading
        them from device tensors would wait for the device. ``pages``: one forward's lookups
        (``gather``'s too), its (pages, offsets) per table kind filled by its first layer and
        read by the others (the same tokens go to the same places in every layer)."""
        if slots.numel() == 0:
            return
        if bounds is None:
            bounds = int(positions.max()) + 1, int(slots.max()) + 1
        self._check(*bounds)
        sliding = self.sliding[layer]
        pages = {} if pages is None else pages
        key = ("store", sliding)
        if key not in pages:
            table = self.windows.table if sliding else self.block_table
            pages[key] = table[slots, positions // self.page_size], positions % self.page_size
        page, offsets = pages[key]
        buffers = self.layers[layer]
        with self._lock:
            for name, values in new.items():
                buffers[name][page, offsets] = values

    def gather(
        self,
        layer: int,
        name: str,
        slots: torch.Tensor | slice,
        length: int,
        start: int = 0,
        pages: dict | None = None,
    ) -> torch.Tensor:
        """Entries ``[start, length)`` of several sequences, ``[num_slots, length - start,
        ...]`` (a copy through the block table); rows past a sequence's own length hold zeros
        or stale finite values, to be masked. ``pages``: one forward's page lookups, filled
        by the first read of each (slots, table, pages), read by every later one: a layer's
        keys and values, and every layer after it, read the same pages."""
        first = start // self.page_size  # a window's read starts at its first page
        sliding, last = self.sliding[layer], pages_for(length, self.page_size)
        pages = {} if pages is None else pages
        key = (id(slots), sliding, first, last)  # the forward's plan holds ``slots``
        if key not in pages:
            table = self.windows.table if sliding else self.block_table
            pages[key] = table[slots, first:last]
        table = pages[key]
        buffer = self.layers[layer][name]
        if buffer.device.type == "cpu":  # whole pages as row copies: a CPU's advanced indexing
            # goes element by element, 4-6x slower for a decode batch's history
            rows = buffer.index_select(0, table.flatten()).unflatten(0, table.shape)
        else:  # one gather kernel (a GPU's launches are what cost)
            rows = buffer[table]
        rows = rows.flatten(1, 2)  # [seqs, pages x page_size, ...]
        skip = first * self.page_size
        return rows[:, start - skip : length - skip]

    def allocate_all(self) -> None:
        """Every buffer at the whole pool now, so none moves later (a CUDA graph holds their
        addresses)."""
        with self._lock:
            self._grow(self.num_pages + 1, sliding=False)
            self._grow(self.windows.total + 1, sliding=True)

    def _check(self, end: int, top: int) -> None:
        if end > self.max_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds the KV cache's max_len={self.max_len}"
            )
        if top > self.num_slots:
            raise IndexError(f"slot {top - 1} is outside the KV cache's {self.num_slots} slots")

    def _grow(self, pages: int, sliding: bool) -> None:
        """Every buffer of the full (or the sliding-window) layers to at least ``pages`` pages,
        geometrically so growth is rare."""
        for buffers, window in zip(self.layers, self.sliding, strict=True):
            if window != sliding:
                continue
            for name, buf in buffers.items():
                have = buf.shape[0]
                if pages <= have:
                    continue
                n = min(
                    (self.windows.total if sliding else self.num_pages) + 1, max(pages, 2 * have)
                )
                with torch.inference_mode(False):  # a plain tensor: writable outside inference
                    grown = buf.new_zeros(n, *buf.shape[1:])
                    grown[:have] = buf
                buffers[name] = grown

    def allocated_bytes(self) -> int:
        """Bytes the page buffers hold now (they grow with the running sequences)."""
        return sum(b.numel() * b.element_size() for layer in self.layers for b in layer.values())
