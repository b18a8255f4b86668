"""``--moe-a2a-backend``: which dispatcher a rank builds."""

from __future__ import annotations

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.timeline import Timeline
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.base import Dispatcher
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.distributed.groups import Group
from moe_overlap.distributed.modelled_link import ModelledLink


def resolve_backend(backend: str, ep: int) -> str:
    """``auto`` picks ``local`` on one rank and ``torch`` on several; others are checked."""
    if backend == "auto":
        return "local" if ep == 1 else "torch"
    if backend == "local" and ep > 1:
        raise ConfigError(
            f"--moe-a2a-backend=local holds every expert on one rank; with --ep={ep} use "
            "torch (or auto)"
        )
    if backend == "torch" and ep == 1:
        raise ConfigError("--moe-a2a-backend=torch needs --ep > 1; use local (or auto)")
    return backend


def make_dispatcher(
    backend: str,
    num_experts: int,
    group: Group,
    link: ModelledLink | None = None,
    timeline: Timeline | None = None,
) -> Dispatcher:
    if resolve_backend(backend, group.size) == "local":
        return LocalDispatcher(num_experts)
    return AllToAllDispatcher(group, num_experts, link, timeline)
