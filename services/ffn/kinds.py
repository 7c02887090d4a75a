"""FFN kinds: the activation between an MLP's fused gate/up projection and its down
projection. One entry per kind, keyed by `ModelConfig.ffn` (named by the family)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from afd.config import ModelConfig
from afd.kernels.moe import SWIGLU, ActSpec
from afd.ops import Linear

# (gate [T, I], up [T, I]) -> [T, I]
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_clamped(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
) -> torch.Tensor:
    """gpt-oss: the gate clamped from above and up on both sides at `limit`, a sigmoid of gain
    `alpha`, and up shifted by one."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


FFN_KINDS: dict[str, Callable[[ModelConfig], Activation]] = {
    "swiglu": lambda cfg: swiglu,
    "swiglu_clamped": lambda cfg: partial(
        swiglu_clamped, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha
    ),
}


def activation(cfg: ModelConfig) -> Activation:
    return FFN_KINDS[cfg.ffn](cfg)


def native_spec(act: Activation) -> ActSpec | None:
    """The activation as the fused native experts compute it (afd/kernels/experts.h), or None
    where they do not."""
    if act is swiglu:
        return SWIGLU
    if isinstance(act, partial) and act.func is swiglu_clamped and not act.args:
        return ("swiglu_clamped", float(act.keywords["limit"]), float(act.keywords["alpha"]))
    return None


def mlp(x: torch.Tensor, w13: Linear, w2: Linear, act: Activation = swiglu) -> torch.Tensor:
    """down(act(gate(x), up(x))) with gate and up fused: w13 [2I, H] (gate rows, then up rows),
    w2 [H, I]; x [T, H] -> [T, H]."""
    gate, up = w13(x).chunk(2, dim=-1)  # [T, I] each
    return w2(act(gate, up))
