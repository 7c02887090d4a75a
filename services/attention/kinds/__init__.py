"""Attention kinds: one file each, one registry entry each."""

from services.attention.kinds.base import AttentionKind
from services.attention.kinds.gqa import GQA
from services.attention.kinds.mfa import MFA

ATTENTION_KINDS: dict[str, type[AttentionKind]] = {"gqa": GQA, "mfa": MFA}

__all__ = ["ATTENTION_KINDS", "GQA", "MFA", "AttentionKind"]
