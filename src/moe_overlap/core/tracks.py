"""The timeline's track names: every writer of a span and every reader of one uses these, so a
renamed track cannot silently drop out of "comm hidden" or auto's calibration.

A micro-batch computes on ``mb<i>`` and blocks on ``mb<i> wait``; an all-to-all (or the gather
backend's collectives) is in flight on ``comm``; attention-TP collectives block on ``tp comm``;
SBO's expert blocks run on ``mb<i> sbo``; a pipeline stage's micro-batch runs on ``pp mb<i>``; PD multiplexing's prefill wave on
``prefill`` (its waits on ``prefill wait``). ``split`` and ``decision`` hold zero-length
marks: each micro-batch's rows, and auto's choice or why a scheme ran without overlap.
"""

from __future__ import annotations

COMM = "comm"
TP_COMM = "tp comm"
SPLIT = "split"
DECISION = "decision"
PREFILL_LANE = "prefill"  # PD multiplexing's prefill wave beside the decode batch
_MICRO_BATCH = "mb"
_WAIT = " wait"
_PIPELINE = "pp "


def micro_batch(i: int) -> str:
    """Micro-batch ``i``'s compute track (and the name of its ``ForwardContext``)."""
    return f"{_MICRO_BATCH}{i}"


FIRST = micro_batch(0)  # the whole batch's track when a forward is not split


def wait(track: str) -> str:
    """Where ``track``'s micro-batch is blocked on a transfer."""
    return track + _WAIT


def sbo_block(track: str) -> str:
    """SBO's expert blocks inside ``track``'s micro-batch (computing, drawn on its lane)."""
    return track + " sbo"


def pipeline(i: int) -> str:
    """A pipeline stage's micro-batch ``i``."""
    return _PIPELINE + micro_batch(i)


def is_pipeline(track: str) -> bool:
    """A pipeline stage's micro-batch (``pipeline``)."""
    return track.startswith(_PIPELINE)


def is_wait(track: str) -> bool:
    return track.endswith(_WAIT)


def is_micro_batch(track: str) -> bool:
    """A micro-batch's track, computing or waiting (not a pipeline stage's)."""
    return track.startswith(_MICRO_BATCH)


def is_compute(track: str) -> bool:
    """A micro-batch computing (not waiting)."""
    return is_micro_batch(track) and not is_wait(track)


def waiter(track: str) -> str:
    """The micro-batch a wait track belongs to."""
    return track.removesuffix(_WAIT)


def known(track: str) -> bool:
    """Whether ``track`` is one of the tracks above (what the readers recognise)."""
    named = track in (COMM, TP_COMM, SPLIT, DECISION, PREFILL_LANE, wait(PREFILL_LANE))
    return named or is_micro_batch(track) or is_pipeline(track)
