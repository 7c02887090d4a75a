"""The two data-plane messages, as in-memory objects.

Network backends turn these into a protobuf header plus raw buffers (`afd.wire`); the
in-process backend hands the objects over as they are. Shapes are fixed by the contract in
`protos/afd/v1/ffn.proto`: T tokens, hidden size H, top-k k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FFNRequest:
    layer: int
    micro_batch: int
    seq: int  # per-sender sequence number, echoed in the reply
    hidden: torch.Tensor  # [T, H] float8_e4m3fn | bfloat16 | float32, after the FFN norm
    scales: torch.Tensor | None  # [T] float32 per-token dequant scales (fp8 only)
    expert_ids: torch.Tensor  # [T, k] int32; k == 0 on dense layers
    expert_weights: torch.Tensor  # [T, k] float32
    sender: str = ""
    deadline: float = 0.0  # absolute time.time(); 0: none
    t_send: float = 0.0  # sender clock, for the timing trace
    # elastic pool: another member computes the shared expert and the dense MLPs (and the ids
    # of experts this member is not to compute are -1)
    skip_dense: bool = False

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]


@dataclass(frozen=True)
class Trace:
    """Timestamps of one round trip; differences are only taken between stamps of one host."""

    a_send: float = 0.0  # attention host
    f_recv: float = 0.0  # FFN host
    f_compute_start: float = 0.0
    f_compute_end: float = 0.0
    f_send: float = 0.0
    a_recv: float = 0.0  # attention host
    merged: int = 1  # how many requests the FFN server computed together
    # Attention host, when the send call returned; kept on the attention side (not on the wire):
    # a_sent - a_send is the attention host's own share of the round trip.
    a_sent: float = 0.0


@dataclass(frozen=True)
class FFNReply:
    seq: int
    layer: int
    micro_batch: int
    output: torch.Tensor | None  # [T, H] bfloat16 (float32 in exact mode); None on error
    error_code: str = ""  # "" ok; else e.g. "bad_request", "internal", "deadline_exceeded"
    error: str = ""
    trace: Trace = field(default_factory=Trace)

    @property
    def ok(self) -> bool:
        return not self.error_code
