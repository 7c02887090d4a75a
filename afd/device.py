"""Where a role computes: the device names flags and configs use, checked once at start-up.

`auto` is the first CUDA device torch sees, else the CPU. Tensors cross a device boundary in
two places only: the attention side's FFN dispatcher (hidden states and routing out to the
host, the FFN's reply back to the attention device) and the FFN engine (a request in to its
device, its output back to the host). The messages between them (afd/messages.py) always hold
host tensors, whatever devices the two ends compute on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.config import check_device
from afd.errors import ConfigError

CPU = torch.device("cpu")


def resolve(spec: str) -> torch.device:
    """The device `spec` names on this host; a CUDA device that is not there is a one-line
    ConfigError, never a crash at the first kernel."""
    check_device(spec)
    if spec == "cpu":
        return CPU
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        return torch.device("cuda", 0) if visible else CPU
    index = int(spec.partition(":")[2] or 0)
    if not visible:
        why = "this torch has no CUDA" if torch.version.cuda is None else "none is visible"
        raise ConfigError(f"--device {spec}: no CUDA device ({why}); use --device cpu")
    if index >= visible:
        raise ConfigError(f"--device {spec}: only {visible} CUDA device(s) are visible")
    return torch.device("cuda", index)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """t on the CPU (itself where it is there already)."""
    return t if t.device.type == "cpu" else t.to(CPU)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device` (itself where it is there already)."""
    return t if t.device == device else t.to(device)


def place(weights: dict, device: torch.device) -> None:
    """Every weight of a loaded dict (dense tensors, and the block-FP8 and MXFP4 weights that
    stay quantized) moved to `device` in place of its host copy, one at a time, so the host
    holds at most the dict as loaded."""
    if device.type == "cpu":
        return
    for name, w in weights.items():
        weights[name] = w.to(device)


@dataclass(frozen=True)
class Memory:
    """A device's memory as the KV planner reads it, in bytes."""

    total: int
    free: int  # what no process holds (this one's weights are already out of it)
    ours: int = 0  # what this process's allocator holds on it (its weights, so far)


def memory(device: torch.device) -> Memory:
    """The device's memory now (CUDA only: a CPU's KV pool is sized in GiB by the flag)."""
    if device.type != "cuda":
        raise ConfigError(f"no memory planning for {device}: size the KV cache in GiB")
    free, total = torch.cuda.mem_get_info(device)
    return Memory(total, free, torch.cuda.memory_reserved(device))
