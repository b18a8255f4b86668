"""SGLang's layout flags (``--tp --dp --enable-dp-attention --ep --pp``) and the DP
controller's ``--load-balance-method``, generated from ``LayoutArgs``."""

from __future__ import annotations

import argparse

from moe_overlap.engine.args import LayoutArgs
from moe_overlap.tools.flags import add_fields

LAYOUT_FLAGS = ("tp", "dp", "enable_dp_attention", "ep", "pp", "load_balance_method")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    add_fields(p, LayoutArgs, only=LAYOUT_FLAGS)
