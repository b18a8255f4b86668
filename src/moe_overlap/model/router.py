"""The MoE router: from a token's hidden state to its experts and their weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.core.model_config import ModelConfig


class Router(nn.Module):
    """Qwen3's softmax top-k, DeepSeek-V3's sigmoid with bias and group-limited top-k, or
    GPT-OSS's top-k of biased logits with a softmax over the chosen."""

    e_score_correction_bias: torch.Tensor  # a buffer, with noaux_tc only

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.is_gpt_oss else None
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        self.skew: torch.Tensor | None = None  # --expert-skew: added to the logits

    def set_skew(self, skew: torch.Tensor | None) -> None:
        """Bias the routing (``--expert-skew``, to show imbalance): ``skew`` per expert is
        added to the router's logits."""
        self.skew = skew

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        out = F.linear(x.float(), self.weight.float(), bias)
        return out if self.skew is None else out + self.skew

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(topk_ids [T, k], topk_weights [T, k])``."""
        cfg = self.cfg
        if cfg.is_gpt_oss:
            chosen, ids = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)
            return ids, chosen.softmax(dim=-1)
        if cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        if cfg.topk_method == "greedy":
            weights, ids = torch.topk(scores, cfg.num_experts_per_tok, dim=-1)
        else:
            choice = scores
            if cfg.topk_method == "noaux_tc":
                choice = scores + self.e_score_correction_bias
            ids = _group_limited_topk(choice, cfg)
            weights = scores.gather(1, ids)
        # transformers' DeepSeek-V2 router ignores norm_topk_prob (it only scales)
        if cfg.norm_topk_prob and cfg.model_type != "deepseek_v2":
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20 if cfg.deepseek_moe else total)
        if cfg.routed_scaling_factor != 1.0:  # x * 1.0 is x: a kernel saved, not a bit changed
            weights = weights * cfg.routed_scaling_factor
        return ids, weights


def _group_limited_topk(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    tokens = choice.shape[0]
    # explicit sizes: an idle micro-batch has zero tokens, and view(0, g, -1) is ambiguous
    grouped = choice.view(tokens, cfg.n_group, cfg.num_experts // cfg.n_group)
    if cfg.topk_method == "noaux_tc":
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    else:  # DeepSeek-V2 group_limited_greedy
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(tokens, cfg.num_experts)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(masked, cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
