"""A family's checkpoint tensor names, as a table, and how they map to afd's canonical names.

Each family names the same tensors its own way (`block_sparse_moe.experts.3.w1` in Mixtral,
`mlp.experts.3.gate_proj` in Qwen3-MoE, one stacked `moe.gate_proj` in Step-3); afd's services
index weights by one set of canonical names (listed in afd/checkpoint.py). The table keeps each
family's spelling with the family, and `canonical` is the one place that reads it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Whole-model tensors, spelled the same by every family so far.
TOP: Mapping[str, str] = MappingProxyType(
    {
        "model.embed_tokens.weight": "embed",
        "model.norm.weight": "final_norm",
        "lm_head.weight": "lm_head",
    }
)
# Per-layer norms, spelled the same by every family so far.
NORMS: Mapping[str, str] = MappingProxyType(
    {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
)
# The usual SwiGLU projection names.
GATE_UP_DOWN: Mapping[str, str] = MappingProxyType(
    {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class WeightNames:
    """One family's HF tensor names -> afd's canonical names.

    A layer tensor is "model.layers.{i}.{rest}.weight" (after the checkpoint's vision-language
    prefix is stripped); `rest` is looked up in order (a tensor that is not a `.weight`, such as
    DeepSeek's "mlp.gate.e_score_correction_bias", is looked up in `layer` by its whole name):
      layer:       rest -> canonical leaf ("self_attn.q_proj" -> "q_proj", "mlp.gate" -> "router")
      mlps:        "{module}.{projection}" for a module holding one whole MLP -> its canonical
                   group ("mlp" -> "mlp" for a dense layer, "share_expert" -> "shared")
      stacked:     "{module}.{projection}" for a module whose tensors stack every expert [E, ...]
      experts:     "{module}.{e}.{projection}" for modules holding one MLP per expert
    with `projections` naming the MLP's matrices (-> "gate", "up", "down"; "gate_up" for one
    matrix whose rows alternate gate and up, which the loader splits).
    A stacked module may also hold its tensors bare (gpt-oss): "{module}.{projection}" [E, ...]
    and its bias "{projection}_bias" [E, out]; `stacked_transposed`: bare matrices are stored
    [E, in, out]. (MXFP4 "{tensor}_blocks" is mapped as "{tensor}" by the loader.)
    """

    layer: Mapping[str, str]
    projections: Mapping[str, str] = field(default_factory=lambda: GATE_UP_DOWN)
    mlps: Mapping[str, str] = field(default_factory=dict)
    stacked: str | None = None
    experts: tuple[str, ...] = ()
    stacked_transposed: bool = False
    top: Mapping[str, str] = field(default_factory=lambda: TOP)

    def canonical(self, key: str) -> str | None:
        """An HF tensor name (prefix stripped) -> its canonical name, or None if afd does not
        use it. A stacked [E, ...] tensor maps to "layers.{i}.experts.*.{part}": the loader
        splits it into one tensor per expert."""
        if key in self.top:
            return self.top[key]
        m = _LAYER_RE.match(key)
        if not m:
            return None
        base, rest = f"layers.{int(m.group(1))}", m.group(2)
        if not rest.endswith(".weight"):
            if rest in self.layer:
                return f"{base}.{self.layer[rest]}"
            return self._bare_stacked(base, rest)
        rest = rest.removesuffix(".weight")
        if rest in self.layer:
            return f"{base}.{self.layer[rest]}"
        module, _, proj = rest.rpartition(".")
        part = self.projections.get(proj)
        if part is None:
            return None
        if module in self.mlps:
            return f"{base}.{self.mlps[module]}.{part}"
        if module == self.stacked:
            return f"{base}.experts.*.{part}"
        owner, _, expert = module.rpartition(".")
        if owner in self.experts and expert.isdecimal():
            return f"{base}.experts.{int(expert)}.{part}"
        return None

    def _bare_stacked(self, base: str, rest: str) -> str | None:
        """ "{stacked}.{projection}[_bias|_blocks]" -> "{base}.experts.*.{part}[_bias]"."""
        module, _, leaf = rest.rpartition(".")
        if self.stacked is None or module != self.stacked:
            return None
        proj, bias = leaf, ""
        for suffix in ("_bias", "_blocks"):
            if leaf.endswith(suffix):
                proj, bias = leaf.removesuffix(suffix), "_bias" if suffix == "_bias" else ""
        part = self.projections.get(proj)
        return None if part is None else f"{base}.experts.*.{part}{bias}"
