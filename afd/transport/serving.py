"""What every network listener does with the messages it received, in one place.

A backend's receive loop collects the messages that arrived together, each with an opaque
`peer` (whatever the backend needs to route the reply back) and its arrival time, and calls
`serve_messages`. That decodes and validates each one (a malformed message gets an error reply
when its seq is known, else it is dropped with a log line), answers expired requests without
computing them, groups the rest by layer and calls the handler once per group, stamps the
timing trace, records the FFN server's metrics (afd.metrics) and encodes the replies. Nothing
raised by the handler escapes: the server keeps serving.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Generic, TypeVar

from afd import metrics
from afd.errors import ConfigError
from afd.transport.base import Handler
from afd.transport.messages import FFNReply, FFNRequest, Trace
from afd.wire import Buffer, WireError, WireLimits, decode_request, encode_reply

log = logging.getLogger(__name__)

P = TypeVar("P")


@dataclasses.dataclass(frozen=True)
class Inbound(Generic[P]):
    peer: P
    frames: Sequence[Buffer]
    t_recv: float  # time.time() when the message arrived


def error_reply(req_or_err: FFNRequest | WireError, code: str, message: str) -> FFNReply:
    seq = req_or_err.seq if req_or_err.seq is not None else -1
    return FFNReply(
        seq=seq,
        layer=req_or_err.layer,
        micro_batch=req_or_err.micro_batch,
        output=None,
        error_code=code,
        error=message,
    )


def _decode(msg: Inbound[P], limits: WireLimits) -> FFNRequest | FFNReply | None:
    try:
        req = decode_request(msg.frames, limits)
    except WireError as e:
        if e.seq is None:
            log.warning("dropped a malformed FFN message from %r: %s", msg.peer, e)
            return None
        log.warning("rejected FFN message %d from %r: %s", e.seq, msg.peer, e)
        return error_reply(e, e.code, e.message)
    if req.deadline and msg.t_recv > req.deadline:
        # The sender has given up on it (e.g. it was queued while this server was down).
        return error_reply(req, "deadline_exceeded", "arrived after its deadline")
    return req


def _compute(handler: Handler, reqs: list[FFNRequest]) -> list[FFNReply]:
    try:
        replies = handler(reqs)
        if len(replies) != len(reqs):
            raise RuntimeError(f"handler gave {len(replies)} replies to {len(reqs)} requests")
    except Exception as e:
        log.exception("FFN handler failed on layer %d (%d requests)", reqs[0].layer, len(reqs))
        return [error_reply(r, "internal", f"{type(e).__name__}: {e}") for r in reqs]
    out = []
    for req, rep in zip(reqs, replies, strict=True):
        if rep.ok and (rep.output is None or tuple(rep.output.shape) != tuple(req.hidden.shape)):
            shape = None if rep.output is None else tuple(rep.output.shape)
            rep = error_reply(
                req, "internal", f"handler output {shape} for {req.num_tokens} tokens"
            )
        out.append(rep)
    return out


def _stamp(
    rep: FFNReply, req: FFNRequest | None, t_recv: float, span: tuple[float, float], n: int
) -> FFNReply:
    # The listener knows when the message arrived (the handler only when it got it, after any
    # queueing); of the rest, fill only what the handler left unset: it may know its compute
    # window better.
    tr = rep.trace
    stamped = Trace(
        a_send=tr.a_send or (req.t_send if req is not None else 0.0),
        f_recv=t_recv or tr.f_recv,
        f_compute_start=tr.f_compute_start or span[0],
        f_compute_end=tr.f_compute_end or span[1],
        f_send=tr.f_send or time.time(),
        a_recv=tr.a_recv,
        merged=tr.merged if tr.merged != 1 else n,
    )
    return dataclasses.replace(rep, trace=stamped)


def _observe(group: list[tuple[Inbound[P], FFNRequest]], replies: list[FFNReply]) -> None:
    """One layer call's metrics. Empty messages (the attention side's readiness pings) are
    left out: they would drag every mean towards zero."""
    done = [(msg, req, rep) for (msg, req), rep in zip(group, replies, strict=True)]
    done = [d for d in done if d[2].ok and d[1].num_tokens]
    if not done:
        return
    tr = done[0][2].trace
    tokens = sum(req.num_tokens for _, req, _ in done)
    metrics.FFN_MESSAGES.inc(len(done))
    metrics.FFN_TOKENS.inc(tokens)
    metrics.FFN_BATCH_TOKENS.observe(tokens)
    metrics.FFN_BATCH_MESSAGES.observe(len(done))
    metrics.FFN_BATCH_PEERS.observe(len({msg.peer for msg, _, _ in done}))
    metrics.FFN_COMPUTE.observe(max(0.0, tr.f_compute_end - tr.f_compute_start))
    for msg, _, rep in done:
        metrics.FFN_QUEUE.observe(max(0.0, rep.trace.f_compute_start - msg.t_recv))


def _encode(peer: P, rep: FFNReply) -> tuple[P, list[Buffer]]:
    if rep.error_code:
        metrics.FFN_ERRORS.labels(rep.error_code).inc()
    try:
        return peer, encode_reply(rep)
    except WireError as e:  # the handler produced something the wire cannot carry
        log.error("cannot encode the reply to %d: %s", rep.seq, e)
        return peer, encode_reply(
            dataclasses.replace(rep, output=None, error_code="internal", error=str(e))
        )


def serve_messages(
    messages: Sequence[Inbound[P]], handler: Handler, limits: WireLimits
) -> list[tuple[P, list[Buffer]]]:
    """Decode, validate, compute (one handler call per layer) and encode replies.

    Returns (peer, reply frames) for every message that gets an answer, in no promised order.
    """
    out: list[tuple[P, list[Buffer]]] = []
    groups: dict[int, list[tuple[Inbound[P], FFNRequest]]] = {}
    for msg in messages:
        item = _decode(msg, limits)
        if isinstance(item, FFNRequest):
            groups.setdefault(item.layer, []).append((msg, item))
        elif item is not None:
            out.append(_encode(msg.peer, _stamp(item, None, msg.t_recv, (0.0, 0.0), 1)))
    for group in groups.values():
        reqs = [req for _, req in group]
        start = time.time()
        replies = _compute(handler, reqs)
        span = (start, time.time())
        stamped = [
            _stamp(rep, req, msg.t_recv, span, len(reqs))
            for (msg, req), rep in zip(group, replies, strict=True)
        ]
        _observe(group, stamped)
        for (msg, _req), rep in zip(group, stamped, strict=True):
            out.append(_encode(msg.peer, rep))
    return out


def stamp_received(reply: FFNReply) -> FFNReply:
    """The attention side's receive stamp (trace.a_recv), taken when the reply is decoded."""
    return dataclasses.replace(reply, trace=dataclasses.replace(reply.trace, a_recv=time.time()))


def require_limits(address: str, limits: WireLimits | None) -> WireLimits:
    """A network listener validates every message against its model: it must know the limits."""
    if limits is None:
        raise ConfigError(
            f"listening on {address} needs limits=WireLimits(...) to validate messages"
        )
    return limits
