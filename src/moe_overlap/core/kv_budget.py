"""How much KV cache a rank gets: the memory budget, and the pages and sequences it holds.

On CPU the budget is ``--kv-cache-memory`` bytes per rank, by default a share of the memory
free at start-up (``CPU_FREE_RAM_SHARE`` of ``MemAvailable``, split over the ranks on this
host). On a GPU it is ``--mem-fraction-static`` (``--gpu-memory-utilization``) of the device's
memory less the rank's weights, or ``--max-total-tokens`` tokens when given.
"""

from __future__ import annotations

import math

CPU_FREE_RAM_SHARE = 0.4  # of MemAvailable at start-up, shared by the ranks on this host
CPU_FALLBACK_BYTES = 4 * 2**30  # where /proc/meminfo cannot be read
DEFAULT_PAGE_SIZE = 16  # tokens per page (vLLM's block size)
DEFAULT_MEM_FRACTION = 0.9  # of a GPU's memory for weights and KV cache (vLLM's default)
# of the KV budget for a hybrid model's recurrent states kept for prefix caching: one state of
# the Hub's Qwen3.5 weighs as much as thousands of tokens' KV, so a share, not one per page
STATE_SNAPSHOT_SHARE = 0.1


def available_ram() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_kv_bytes(ranks_on_host: int, free: int | None = None) -> int:
    """The CPU default per rank: ``CPU_FREE_RAM_SHARE`` of the free memory over the ranks."""
    free = available_ram() if free is None else free
    if free is None:
        return CPU_FALLBACK_BYTES
    return int(free * CPU_FREE_RAM_SHARE) // max(1, ranks_on_host)


def gpu_kv_bytes(total: int, fraction: float, weight_bytes: int) -> int:
    """A GPU's KV budget: ``fraction`` of its memory less the rank's weights (at least 0)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"mem_fraction_static={fraction} must be in (0, 1]")
    return max(0, int(total * fraction) - weight_bytes)


def mtp_rows_ahead(mtp_steps: int) -> int:
    """Positions past a step's computed tokens whose keys and values the MTP drafter writes,
    in the sequence's own pages: its decode steps, one a draft after the first
    (``runtime/mtp_drafter.py``); none without MTP drafts."""
    return max(0, mtp_steps - 1)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages a sequence of ``tokens`` tokens takes."""
    return math.ceil(tokens / page_size)
