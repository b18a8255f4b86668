"""What a forward hands across modules: where a pipeline stage starts, and what a forward gives.

Inside an op list the ops pass each other keyword dicts (``overlap/operations.py``); at the
edges, where a scheme returns to the runner or a stage hands on to the next, these types say
which of the two outcomes a forward had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StageInputs:
    """A pipeline stage's start: the previous stage's per-token hidden states and residual."""

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        """As the first op of a stage takes them (and as ``Group.send_dict`` sends them)."""
        return {"hidden_states": self.hidden_states, "residual": self.residual}

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> StageInputs:
        return cls(tensors["hidden_states"], tensors["residual"])


@dataclass
class ForwardOutputs:
    """The logits of the rows the batch asked for (the last stage), or what the next stage
    starts from (a stage before it)."""

    logits: torch.Tensor | None = None
    next_stage: StageInputs | None = None
    # every row's final (normed) hidden state, in batch order, where the model keeps them
    # (``MoeForCausalLM.keep_hidden``: the MTP drafter's input)
    hidden: torch.Tensor | None = None

    @classmethod
    def of(cls, out: dict) -> ForwardOutputs:
        """From an op list's last output."""
        if "logits" in out:
            return cls(logits=out["logits"], hidden=out.get("hidden"))
        return cls(next_stage=StageInputs.from_dict(out))

    def final_logits(self) -> torch.Tensor:
        if self.logits is None:
            raise RuntimeError("this forward ran a pipeline stage before the last: no logits")
        return self.logits

    def handoff(self) -> StageInputs:
        if self.next_stage is None:
            raise RuntimeError("this forward ran the last stage: nothing to hand on")
        return self.next_stage


def op_inputs(inputs: StageInputs | None) -> dict | None:
    """The first op's keyword arguments: none on the first stage."""
    return None if inputs is None else inputs.as_dict()
