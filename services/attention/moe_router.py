"""MoE routers: which experts each token goes to, and with what weight. One entry per kind.

Keyed by router kind, not by model family: a family names its kind (afd/families), which
reaches the attention model as `ModelConfig.router`, so families that route alike share one.
Whatever the kind, its output is what goes on the wire: expert ids and weights per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd.config import ModelConfig

# (router logits [T, E], config, the layer's selection bias [E] float32 or None)
#   -> expert ids [T, k] int32, weights [T, k] float32
RouterFn = Callable[
    [torch.Tensor, ModelConfig, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]


def softmax_topk(
    logits: torch.Tensor,  # [T, E] router logits, in the compute dtype
    cfg: ModelConfig,
    bias: torch.Tensor | None = None,  # unused: this kind has none
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [T, k] int32, weights [T, k] float32
    """Softmax over all experts (float32), top-k, renormalised if the model says so."""
    # Ops as transformers runs them (ties in top-k resolve alike), no more: this runs per
    # layer and at batch 1 each op's dispatch costs about what its arithmetic does.
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def sigmoid_group_topk(
    logits: torch.Tensor,  # [T, E]
    cfg: ModelConfig,
    bias: torch.Tensor | None,  # [E] float32: e_score_correction_bias
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [T, k] int32, weights [T, k] float32
    """DeepSeek-V3: sigmoid scores; the bias shifts which experts are chosen, never their
    weights; only experts of the `topk_group` groups with the best two-expert sums compete;
    weights renormalised if the model says so, then scaled by `routed_scaling_factor`."""
    scores = torch.sigmoid(logits.float())  # [T, E]
    choice = scores if bias is None else scores + bias
    T, E = choice.shape
    if cfg.n_group > 1:
        groups = choice.view(T, cfg.n_group, E // cfg.n_group)
        group_scores = groups.topk(min(2, E // cfg.n_group), dim=-1).values.sum(-1)  # [T, G]
        best = group_scores.topk(cfg.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // cfg.n_group, dim=1), -torch.inf)
    ids = choice.topk(cfg.top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * cfg.routed_scaling_factor


def topk_softmax(
    logits: torch.Tensor,  # [T, E]
    cfg: ModelConfig,
    bias: torch.Tensor | None,  # [E] float32: added to the logits
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [T, k] int32, weights [T, k] float32
    """gpt-oss: the top-k logits (bias added), then a softmax over those k alone."""
    scores = logits.float() if bias is None else logits.float() + bias
    top, ids = torch.topk(scores, cfg.top_k, dim=-1)
    return ids.to(torch.int32), torch.softmax(top, dim=-1)


ROUTERS: dict[str, RouterFn] = {
    "topk_softmax": topk_softmax,
    "softmax_topk": softmax_topk,
    "sigmoid_group_topk": sigmoid_group_topk,
}
