"""Attention kinds: one file each, one registry entry each."""

from services.attention.kinds.base import AttentionKind
from services.attention.kinds.dsa import DSA
from services.attention.kinds.gqa import GQA
from services.attention.kinds.mfa import MFA
from services.attention.kinds.mla import MLA

ATTENTION_KINDS: dict[str, type[AttentionKind]] = {
    "gqa": GQA,
    "mfa": MFA,
    "mla": MLA,
    "dsa": DSA,
}

__all__ = ["ATTENTION_KINDS", "DSA", "GQA", "MFA", "MLA", "AttentionKind"]
