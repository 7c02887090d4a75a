"""MoE routers: which experts each token goes to, and with what weight. One entry per kind.

Keyed by router kind, not by model family: a family names its kind (afd/families), which
reaches the attention model as `ModelConfig.router`, so families that route alike share one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd.config import ModelConfig

RouterFn = Callable[[torch.Tensor, ModelConfig], tuple[torch.Tensor, torch.Tensor]]


def softmax_topk(
    logits: torch.Tensor,  # [T, E] router logits, in the compute dtype
    cfg: ModelConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [T, k] int32, weights [T, k] float32
    """Softmax over all experts (float32), top-k, renormalised if the model says so."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


ROUTERS: dict[str, RouterFn] = {"softmax_topk": softmax_topk}
