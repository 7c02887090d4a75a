"""Compute dtypes by the names configs and flags use."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32}


def compute_dtype(name: str) -> torch.dtype:
    return DTYPES[name]
