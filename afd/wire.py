"""The one converter between data-plane messages and bytes on the wire.

A message is a list of frames: the serialized protobuf header (protos/afd/v1/ffn.proto), then
raw tensor buffers. A2F: [FFNRequestHeader, hidden [T, H], scales [T] f32 (fp8 only, else
empty), expert ids [T, k] i32, expert weights [T, k] f32]. F2A: [FFNReplyHeader, output [T, H]].
Encoding is zero-copy (memoryviews over the tensors); decoding builds tensors over the received
buffers without copying, after validating every field against the header and the server's
`WireLimits`. No pickle: only the schema and raw little-endian numbers cross the wire.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from afd.config import ModelConfig
from afd.errors import TransportError
from afd.messages import FFNReply, FFNRequest, Trace
from afd.protos import ensure_generated
from afd.quant import buffer_to_tensor, tensor_to_buffer

ensure_generated()
from afd.v1 import ffn_pb2 as pb  # noqa: E402 - generated on first use just above

assert sys.byteorder == "little", "the wire format is little-endian"

PROTOCOL_VERSION = pb.PROTOCOL_VERSION_CURRENT
MAX_HEADER_BYTES = 4096  # a real header is < 200 bytes; refuse to parse anything huge
MAX_SENDER_CHARS = 256

Buffer = bytes | bytearray | memoryview
REQUEST_FRAMES = 5
REPLY_FRAMES = 2

_TO_WIRE = {
    torch.float8_e4m3fn: pb.DTYPE_FP8_E4M3,
    torch.bfloat16: pb.DTYPE_BF16,
    torch.float32: pb.DTYPE_FP32,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}
# FFNReply.error_code <-> Status; codes without an enum value travel as STATUS_OTHER + string.
_STATUS = {
    "bad_request": pb.STATUS_BAD_REQUEST,
    "internal": pb.STATUS_INTERNAL,
    "deadline_exceeded": pb.STATUS_DEADLINE_EXCEEDED,
    "unavailable": pb.STATUS_UNAVAILABLE,
    "bad_version": pb.STATUS_BAD_VERSION,
    "bad_header": pb.STATUS_BAD_HEADER,
    "bad_size": pb.STATUS_BAD_SIZE,
    "bad_value": pb.STATUS_BAD_VALUE,
}
_STATUS_NAME = {v: k for k, v in _STATUS.items()}
WIRE_ERROR_CODES = ("bad_header", "bad_version", "bad_size", "bad_value")


class WireError(TransportError):
    """A message that does not follow the wire contract.

    `code` is one of WIRE_ERROR_CODES. When the header could be read, `seq`, `layer` and
    `micro_batch` say which request it was, so that the sender can be answered.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        seq: int | None = None,
        layer: int = 0,
        micro_batch: int = 0,
    ):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.seq = seq
        self.layer = layer
        self.micro_batch = micro_batch


@dataclass(frozen=True)
class WireLimits:
    """What a receiving FFN server accepts: its model's shape and its batch ceiling."""

    hidden_size: int
    num_layers: int
    num_experts: int
    max_tokens: int
    top_k: int
    # moe_layers[i]: layer i takes exactly top_k experts per token, else none (a dense layer);
    # empty: any k up to top_k on any layer
    moe_layers: tuple[bool, ...] = ()

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame a valid request has: the hidden states in fp32 (or the header)."""
        return max(MAX_HEADER_BYTES, self.max_tokens * self.hidden_size * 4)

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_tokens: int) -> WireLimits:
        return cls(
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_experts=cfg.num_experts,
            max_tokens=max_tokens,
            top_k=cfg.top_k,
            moe_layers=cfg.moe_layers,
        )


def _dtype_code(t: torch.Tensor, what: str, allowed: Sequence[torch.dtype]) -> int:
    if t.dtype not in allowed:
        raise WireError("bad_value", f"{what} dtype {t.dtype} cannot be sent (one of {allowed})")
    return _TO_WIRE[t.dtype]


def encode_request(req: FFNRequest) -> list[Buffer]:
    """FFNRequest -> [header, hidden, scales, expert_ids, expert_weights] (zero-copy views)."""
    hidden = req.hidden  # [T, H]
    if hidden.dim() != 2:
        raise WireError("bad_value", f"hidden must be [T, H], got {tuple(hidden.shape)}")
    t, h = hidden.shape
    code = _dtype_code(hidden, "hidden", tuple(_TO_WIRE))
    fp8 = hidden.dtype == torch.float8_e4m3fn
    if fp8 and (req.scales is None or req.scales.shape != (t,)):
        raise WireError("bad_value", "fp8 hidden states need scales [T]")
    scales = req.scales.to(torch.float32) if fp8 else torch.empty(0, dtype=torch.float32)  # [T]
    ids = req.expert_ids.to(torch.int32)  # [T, k]; routers produce int64
    weights = req.expert_weights.to(torch.float32)  # [T, k]
    if ids.dim() != 2 or ids.shape[0] != t or weights.shape != ids.shape:
        raise WireError(
            "bad_value",
            f"expert ids {tuple(ids.shape)} / weights "
            f"{tuple(weights.shape)} must both be [T={t}, k]",
        )
    buffers = [tensor_to_buffer(x) for x in (hidden, scales, ids, weights)]
    header = _build(
        pb.FFNRequestHeader,
        version=PROTOCOL_VERSION, sender=req.sender, seq=req.seq, layer=req.layer,
        micro_batch=req.micro_batch, num_tokens=t, hidden_size=h, top_k=ids.shape[1],
        hidden_dtype=code, hidden_bytes=buffers[0].nbytes, scales_bytes=buffers[1].nbytes,
        expert_ids_bytes=buffers[2].nbytes, expert_weights_bytes=buffers[3].nbytes,
        deadline=req.deadline, t_send=req.t_send, skip_dense=req.skip_dense,
    )  # fmt: skip
    return [header.SerializeToString(), *buffers]


def _build(message_type: Any, **fields: Any) -> Any:
    try:
        return message_type(**fields)
    except (TypeError, ValueError) as e:  # e.g. a negative layer for a uint32 field
        raise WireError("bad_value", f"cannot encode {message_type.__name__}: {e}") from None


def _parse(message_type: Any, frames: Sequence[Buffer], count: int) -> Any:
    if len(frames) < 1:
        raise WireError("bad_header", "empty message")
    raw = frames[0]
    if memoryview(raw).nbytes > MAX_HEADER_BYTES:
        raise WireError("bad_header", f"header of {memoryview(raw).nbytes} bytes")
    try:
        header = message_type.FromString(bytes(raw))
    except Exception as e:  # DecodeError, or anything else a hostile buffer provokes
        raise WireError("bad_header", f"unparseable header ({type(e).__name__})") from None
    if header.version == 0:  # absent: most likely not one of our messages at all
        raise WireError("bad_header", "no protocol version in the header")
    if header.version != PROTOCOL_VERSION:
        raise WireError(
            "bad_version",
            f"protocol version {header.version}, this server speaks {PROTOCOL_VERSION}",
            seq=header.seq,
        )
    if len(frames) != count:
        raise WireError("bad_header", f"{len(frames)} frames, expected {count}", seq=header.seq)
    return header


def _check_size(what: str, declared: int, frame: Buffer, expected: int, where: dict) -> None:
    actual = memoryview(frame).nbytes
    if declared != expected or actual != expected:
        raise WireError(
            "bad_size",
            f"{what}: header says {declared} bytes, frame has {actual}, shape needs {expected}",
            **where,
        )


def _check_finite(what: str, a: np.ndarray, where: dict) -> None:
    if a.size and not np.isfinite(a).all():
        raise WireError("bad_value", f"{what} contains non-finite values", **where)


def _check_fields(
    layer: int,
    shape: tuple[int, int, int],  # (T, H, k)
    sender: str,
    times: tuple[float, float],  # (deadline, t_send)
    limits: WireLimits,
    where: dict,
) -> None:
    """A request's numbers against the server's limits, whichever way it arrived."""
    t, h, k = shape
    problem = None
    if h != limits.hidden_size:
        problem = f"hidden size {h}, this server's is {limits.hidden_size}"
    elif not 0 <= layer < limits.num_layers:
        problem = f"layer {layer} of a {limits.num_layers}-layer model"
    elif k > min(limits.top_k, limits.num_experts):
        problem = f"top_k {k} > {limits.top_k} ({limits.num_experts} experts)"
    elif limits.moe_layers and k != (limits.top_k if limits.moe_layers[layer] else 0):
        want = limits.top_k if limits.moe_layers[layer] else 0
        problem = f"{k} experts per token on layer {layer}, which takes {want}"
    elif t > limits.max_tokens:
        problem = f"{t} tokens > this server's limit {limits.max_tokens}"
    elif len(sender) > MAX_SENDER_CHARS:
        problem = "sender name too long"
    elif not all(math.isfinite(x) for x in times):
        problem = "non-finite deadline or t_send"
    if problem:
        raise WireError("bad_value", problem, **where)


def _check_values(
    scales: torch.Tensor | None,  # [T] float32, fp8 only
    ids: torch.Tensor,  # [T, k] int
    weights: torch.Tensor,  # [T, k] float32
    limits: WireLimits,
    where: dict,
) -> None:
    # The checks read the small tensors through numpy views: on tensors this small the same
    # torch ops are mostly op dispatch, and they run for every message of every layer.
    if scales is not None:
        sc = scales.numpy()
        _check_finite("scales", sc, where)
        if sc.size and sc.min() < 0:
            raise WireError("bad_value", "negative fp8 scale", **where)
    if ids.numel():
        id_view = ids.numpy()
        lo, hi = int(id_view.min()), int(id_view.max())
        # -1: an expert that another member of an elastic pool computes
        if lo < -1 or hi >= limits.num_experts:
            message = f"expert ids span [{lo}, {hi}], outside [-1, {limits.num_experts})"
            raise WireError("bad_value", message, **where)
    _check_finite("expert weights", weights.numpy(), where)


def check_request(req: FFNRequest, limits: WireLimits) -> None:
    """Validate a request handed over in memory (the in-process transport) exactly as
    `decode_request` validates one from the wire; raises WireError."""
    where = {"seq": req.seq, "layer": req.layer, "micro_batch": req.micro_batch}
    hidden = req.hidden  # [T, H]
    if hidden.dim() != 2 or hidden.dtype not in _TO_WIRE:
        raise WireError("bad_value", f"hidden {hidden.dtype} {tuple(hidden.shape)}", **where)
    t, h = hidden.shape
    ids, weights = req.expert_ids, req.expert_weights  # [T, k], [T, k]
    if ids.dim() != 2 or ids.shape[0] != t or weights.shape != ids.shape:
        shapes = f"{tuple(ids.shape)} / {tuple(weights.shape)}"
        raise WireError("bad_value", f"expert ids / weights {shapes} for {t} tokens", **where)
    if ids.is_floating_point() or weights.dtype != torch.float32:
        raise WireError("bad_value", f"expert ids {ids.dtype} / weights {weights.dtype}", **where)
    times = (req.deadline, req.t_send)
    _check_fields(req.layer, (t, h, ids.shape[1]), req.sender, times, limits, where)
    scales = req.scales
    if hidden.dtype == torch.float8_e4m3fn:
        if scales is None or tuple(scales.shape) != (t,) or scales.dtype != torch.float32:
            raise WireError("bad_value", "fp8 hidden states need float32 scales [T]", **where)
    else:
        scales = None
    _check_values(scales, ids, weights, limits, where)


def decode_request(frames: Sequence[Buffer], limits: WireLimits) -> FFNRequest:
    """Validate and convert received frames; raises WireError on anything malformed.

    The tensors share memory with `frames` (read-only use).
    """
    hd = _parse(pb.FFNRequestHeader, frames, REQUEST_FRAMES)
    where = {"seq": hd.seq, "layer": hd.layer, "micro_batch": hd.micro_batch}
    dtype = _FROM_WIRE.get(hd.hidden_dtype)
    if dtype is None:
        raise WireError("bad_value", f"unknown hidden dtype {hd.hidden_dtype}", **where)
    t, h, k = hd.num_tokens, hd.hidden_size, hd.top_k
    _check_fields(hd.layer, (t, h, k), hd.sender, (hd.deadline, hd.t_send), limits, where)
    fp8 = dtype == torch.float8_e4m3fn
    _check_size("hidden", hd.hidden_bytes, frames[1], t * h * dtype.itemsize, where)
    _check_size("scales", hd.scales_bytes, frames[2], t * 4 if fp8 else 0, where)
    _check_size("expert ids", hd.expert_ids_bytes, frames[3], t * k * 4, where)
    _check_size("expert weights", hd.expert_weights_bytes, frames[4], t * k * 4, where)
    hidden = buffer_to_tensor(frames[1], dtype, (t, h))  # [T, H]
    scales = buffer_to_tensor(frames[2], torch.float32, (t,)) if fp8 else None  # [T]
    ids = buffer_to_tensor(frames[3], torch.int32, (t, k))  # [T, k]
    weights = buffer_to_tensor(frames[4], torch.float32, (t, k))  # [T, k]
    _check_values(scales, ids, weights, limits, where)
    return FFNRequest(
        layer=hd.layer,
        micro_batch=hd.micro_batch,
        seq=hd.seq,
        hidden=hidden,
        scales=scales,
        expert_ids=ids,
        expert_weights=weights,
        sender=hd.sender,
        deadline=hd.deadline,
        t_send=hd.t_send,
        skip_dense=hd.skip_dense,
    )


def encode_reply(reply: FFNReply) -> list[Buffer]:
    """FFNReply -> [header, output] (output empty on error; zero-copy view otherwise)."""
    tr = reply.trace
    header = _build(
        pb.FFNReplyHeader,
        version=PROTOCOL_VERSION, seq=reply.seq, layer=reply.layer, micro_batch=reply.micro_batch,
        message=reply.error, trace=_build(pb.Trace,
            a_send=tr.a_send, f_recv=tr.f_recv, f_compute_start=tr.f_compute_start,
            f_compute_end=tr.f_compute_end, f_send=tr.f_send, a_recv=tr.a_recv, merged=tr.merged),
    )  # fmt: skip
    if not reply.ok:
        header.status = _STATUS.get(reply.error_code, pb.STATUS_OTHER)
        if header.status == pb.STATUS_OTHER:
            header.other_code = reply.error_code
        return [header.SerializeToString(), b""]
    out = reply.output  # [T, H]
    if out is None or out.dim() != 2:
        raise WireError("bad_value", "a successful reply needs an output [T, H]")
    header.output_dtype = _dtype_code(out, "output", (torch.bfloat16, torch.float32))
    buf = tensor_to_buffer(out)
    header.num_tokens, header.hidden_size = out.shape
    header.output_bytes = buf.nbytes
    return [header.SerializeToString(), buf]


def decode_reply(frames: Sequence[Buffer], limits: WireLimits | None = None) -> FFNReply:
    """Validate and convert a received reply; raises WireError on anything malformed.

    With `limits`, the hidden size and token count are checked too. `output` shares memory
    with `frames` (read-only use).
    """
    hd = _parse(pb.FFNReplyHeader, frames, REPLY_FRAMES)
    where = {"seq": hd.seq, "layer": hd.layer, "micro_batch": hd.micro_batch}
    tr = hd.trace
    trace = Trace(
        a_send=tr.a_send, f_recv=tr.f_recv, f_compute_start=tr.f_compute_start,
        f_compute_end=tr.f_compute_end, f_send=tr.f_send, a_recv=tr.a_recv, merged=tr.merged,
    )  # fmt: skip
    if hd.status != pb.STATUS_OK:
        code = hd.other_code if hd.status == pb.STATUS_OTHER else _STATUS_NAME.get(hd.status)
        return FFNReply(
            seq=hd.seq,
            layer=hd.layer,
            micro_batch=hd.micro_batch,
            output=None,
            error_code=(code or "internal")[:64],
            error=hd.message,
            trace=trace,
        )
    dtype = _FROM_WIRE.get(hd.output_dtype)
    if dtype not in (torch.bfloat16, torch.float32):
        raise WireError("bad_value", f"output dtype {hd.output_dtype}", **where)
    t, h = hd.num_tokens, hd.hidden_size
    if limits is not None and (h != limits.hidden_size or t > limits.max_tokens):
        raise WireError("bad_value", f"output [{t}, {h}] outside this model's limits", **where)
    _check_size("output", hd.output_bytes, frames[1], t * h * dtype.itemsize, where)
    output = buffer_to_tensor(frames[1], dtype, (t, h))  # [T, H]
    return FFNReply(
        seq=hd.seq, layer=hd.layer, micro_batch=hd.micro_batch, output=output, trace=trace
    )
