"""An independent, deliberately plain step3_text forward pass: the oracle afd is tested against.

Written from the math in REFERENCE.md, not from afd's model code, and it imports nothing from
afd: a bug shared by both would otherwise pass unnoticed. No KV cache, no batching, no
disaggregation: every call recomputes the whole sequence in float32 (by default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

State = dict[str, torch.Tensor]


def load_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a plain dict (the text config of a vision-language wrapper)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def load_state(model_dir: str | Path) -> State:
    """Every tensor of a (possibly sharded) safetensors checkpoint, with any
    `language_model.` prefix removed."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    state: State = {}
    for f in files:
        for name, t in load_file(str(d / f)).items():
            state[name.removeprefix("language_model.")] = t
    return state


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 500000.0)))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding over the full head dim; x [T, n, d], positions 0..T-1."""
    t, _, d = x.shape
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, d]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _attention(s: State, p: str, cfg: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    heads, hd = cfg["num_attention_heads"], cfg["head_dim"]
    groups = cfg.get("num_attention_groups", 1)
    eps = cfg["rms_norm_eps"]
    q = x @ s[p + "q_proj.weight"].T  # [T, share_q_dim]
    q = _rms_norm(q, s[p + "inter_norm.weight"], eps) @ s[p + "wq.weight"].T
    q = q.view(t, heads, hd)
    k = (x @ s[p + "k_proj.weight"].T).view(t, groups, hd)
    v = (x @ s[p + "v_proj.weight"].T).view(t, groups, hd)
    theta = _rope_theta(cfg)
    q, k = _rope(q, theta), _rope(k, theta)
    # each K/V group serves heads/groups consecutive query heads (1 group in Step-3: all of them)
    k = k.repeat_interleave(heads // groups, dim=1)  # [T, heads, hd]
    v = v.repeat_interleave(heads // groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5  # [heads, T, T]
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)  # [T, heads, hd]
    return out.reshape(t, heads * hd) @ s[p + "o_proj.weight"].T


def _gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _moe(s: State, p: str, cfg: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    probs = (x.float() @ s[p + "moe.gate.weight"].float().T).softmax(dim=-1)  # [T, E]
    weights, ids = probs.topk(cfg["moe_top_k"], dim=-1)  # [T, k]
    if cfg.get("norm_expert_weight", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    gate, up, down = (s[p + f"moe.{n}_proj.weight"] for n in ("gate", "up", "down"))
    out = torch.zeros_like(x)
    # token by token, expert by expert: slow and obviously right
    for i in range(x.shape[0]):
        for w, e in zip(weights[i].tolist(), ids[i].tolist(), strict=True):
            out[i] += w * _gated_mlp(x[i : i + 1], gate[e], up[e], down[e])[0]
    if p + "share_expert.gate_proj.weight" in s:
        out = out + _gated_mlp(
            x,
            s[p + "share_expert.gate_proj.weight"],
            s[p + "share_expert.up_proj.weight"],
            s[p + "share_expert.down_proj.weight"],
        )
    return out


def _moe_layer_ids(cfg: dict[str, Any]) -> set[int]:
    enum = cfg.get("moe_layers_enum")
    if enum is None:
        return set(range(1, cfg["num_hidden_layers"]))
    if isinstance(enum, str):
        return {int(i) for i in enum.split(",") if i.strip()}
    return {int(i) for i in enum}


def forward(
    state: State, cfg: dict[str, Any], token_ids: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Logits [T, V] for every position of `token_ids`."""
    s = {k: v.to(dtype) for k, v in state.items()}
    eps = cfg["rms_norm_eps"]
    moe_layers = _moe_layer_ids(cfg)
    h = s["model.embed_tokens.weight"][torch.tensor(token_ids, dtype=torch.long)]  # [T, H]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms_norm(h, s[p + "input_layernorm.weight"], eps)
        h = h + _attention(s, p + "self_attn.", cfg, x)
        x = _rms_norm(h, s[p + "post_attention_layernorm.weight"], eps)
        if i in moe_layers:
            h = h + _moe(s, p, cfg, x)
        else:
            mlp = [s[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")]
            h = h + _gated_mlp(x, *mlp)
    h = _rms_norm(h, s["model.norm.weight"], eps)
    head = s.get("lm_head.weight", s["model.embed_tokens.weight"])  # tied if absent
    return h @ head.T


def greedy_generate(
    state: State,
    cfg: dict[str, Any],
    prompt_ids: list[int],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    ignore_eos: bool = False,
) -> list[int]:
    """The greedy continuation (new tokens only), recomputing everything each step.

    Stops after emitting an `eos_token_id` of the config (kept in the output) unless
    `ignore_eos`."""
    eos = cfg.get("eos_token_id")
    eos_ids = set() if ignore_eos or eos is None else set(eos if isinstance(eos, list) else [eos])
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(forward(state, cfg, ids, dtype)[-1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt in eos_ids:
            break
    return out
