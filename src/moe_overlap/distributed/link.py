"""`--link`: the emulated cross-node link that expert-parallel ranks talk over.

`--link none` is plain loopback; `--link netns:RATE` puts each rank in its own network namespace
on a private bridge shaped by `tc tbf`; `--link model:BANDWIDTH,LATENCY` adds a modelled delay to
each collective where namespaces are not permitted (modelled_link.py, netns.py). On a GPU a
modelled transfer holds the communication stream; `model:BANDWIDTH,LATENCY,WAIT` says how
(`distributed/gpu_wait.py`): `host` (the default: a host function sleeping, no SM held, but
0.3-0.5 ms of wake-up per transfer), `globaltimer` (a one-warp kernel spinning on the GPU's
clock: no wake-up, one SM slot held) or `sleep`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# tc's rate units (case-insensitive, as tc reads them); note `mbps` is megaBYTES per second.
_RATE_BITS = {"bit": 1.0, "bps": 8.0}
for _i, _p in enumerate("kmgt", start=1):
    _RATE_BITS |= {f"{_p}bit": 1000.0**_i, f"{_p}ibit": 1024.0**_i}
    _RATE_BITS |= {f"{_p}bps": 8 * 1000.0**_i, f"{_p}ibps": 8 * 1024.0**_i}
_TIME_S = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUMBER_UNIT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([a-z]+)")
_FORMS = (
    "none | netns:RATE (e.g. netns:2gbit) | model:BANDWIDTH,LATENCY[,WAIT] (e.g. "
    "model:2gbit,50us; WAIT, how a GPU holds the stream: host, globaltimer or sleep)"
)
GPU_WAITS = ("host", "globaltimer", "sleep")  # the ways of gpu_wait.hold_stream
_RATE_EXAMPLES = "2gbit, 500mbit, 100kbit, 100mbps (tc units: bit/s, or bps = bytes/s)"


def parse_rate(text: str) -> float:
    """Parse a tc rate such as `2gbit` or `100mbps` into bytes per second."""
    match = _NUMBER_UNIT.fullmatch(text.strip().lower())
    if match is None or match[2] not in _RATE_BITS or float(match[1]) <= 0:
        raise ValueError(
            f"bad rate {text!r}: expected a positive number and unit, e.g. {_RATE_EXAMPLES}"
        )
    return float(match[1]) * _RATE_BITS[match[2]] / 8


def parse_latency(text: str) -> float:
    """Parse a latency such as `50us`, `2ms` or `0.1s` into seconds."""
    match = _NUMBER_UNIT.fullmatch(text.strip().lower())
    if match is None or match[2] not in _TIME_S:
        raise ValueError(f"bad latency {text!r}: expected a number and us/ms/s, e.g. 50us, 2ms")
    return float(match[1]) * _TIME_S[match[2]]


@dataclass(frozen=True)
class LinkSpec:
    """What `--link` asked for: no link, a shaped namespace link, or a modelled delay."""

    kind: Literal["none", "netns", "model"]
    bytes_per_s: float | None = None
    latency_s: float = 0.0
    spec: str = ""  # the text as given, for reports that must say which link ran
    gpu_wait: str = "host"  # how a GPU holds its stream for a modelled transfer

    @property
    def shaped(self) -> bool:
        """Whether a link is shaped or modelled (not plain loopback)."""
        return self.kind != "none"

    def __post_init__(self) -> None:
        if self.kind not in ("none", "netns", "model"):
            raise ValueError(f"unknown link kind {self.kind!r}; accepted: {_FORMS}")
        rate_ok = self.bytes_per_s is None if self.kind == "none" else (self.bytes_per_s or 0) > 0
        if not rate_ok or self.latency_s < 0:
            raise ValueError(f"{self.kind} link needs a rate > 0 (none: no rate), latency >= 0")
        if self.gpu_wait not in GPU_WAITS:
            raise ValueError(f"unknown wait {self.gpu_wait!r}: one of {', '.join(GPU_WAITS)}")


def parse_link(spec: str) -> LinkSpec:
    """Parse the CLI value of `--link`; raise ValueError naming the value and the accepted forms."""
    if not isinstance(spec, str):
        raise ValueError(f"bad --link {spec!r}: give a string; accepted: {_FORMS}")
    kind, _, arg = spec.strip().partition(":")
    try:
        if kind == "none" and not arg:
            return LinkSpec("none", spec=spec)
        if kind == "netns" and arg:
            return LinkSpec("netns", parse_rate(arg), spec=spec)
        if kind == "model" and arg.count(",") in (1, 2):
            bandwidth, latency, *wait = arg.split(",")
            rate, delay = parse_rate(bandwidth), parse_latency(latency)
            return LinkSpec("model", rate, delay, spec=spec, gpu_wait=(wait or ["host"])[0])
    except ValueError as error:
        raise ValueError(f"bad --link {spec!r}: {error}; accepted: {_FORMS}") from None
    raise ValueError(f"bad --link {spec!r}; accepted: {_FORMS}")
