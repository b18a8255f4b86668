"""The ``moe-overlap`` command line's entry. A command that will fork ranks starts the rank fork
server first, so that its import of torch runs beside this process's own instead of after it
(about 3 s of an ep=2 start on two cores); then the commands (``commands.py``) load and run."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from moe_overlap.runtime.zygote import zygote

RANKED = frozenset({"generate", "bench", "bench-engine", "serve", "bench-serve", "plan"})
LAYOUT_FLAGS = ("--tp", "--dp", "--ep", "--pp", "--emulate-peers")


def forks_ranks(argv: Sequence[str]) -> bool:
    """Whether ``argv`` plainly asks for ranks: a command that runs an engine, a layout flag
    above 1, no --help and not under torchrun (whose ranks are its own). A guess made before
    anything is parsed; a wrong one costs a second import of torch, or the head start."""
    if not argv or argv[0] not in RANKED or "TORCHELASTIC_RUN_ID" in os.environ:
        return False
    if "-h" in argv or "--help" in argv:
        return False
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name in LAYOUT_FLAGS:
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            if value.isdigit() and int(value) > 1:
                return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if forks_ranks(argv):
        zygote()
    from moe_overlap.tools.commands import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
