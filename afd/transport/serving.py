"""The FFN side's one serving loop, shared by every transport backend.

A backend receives messages and hands them here, each with an opaque `peer` (whatever it needs
to route the reply back) and its arrival time; network backends pass the raw frames
(`serve_frames`), the in-process backend passes the request objects (`serve_requests`). Either
way every message is validated once against the server's `WireLimits` (a malformed message
gets an error reply when its seq is known, else it is dropped with a log line), a draining
server answers every message with a typed `unavailable` error, an expired message is answered
without being computed, and the rest are grouped by layer with one `compute` call per layer.
Here the timing trace is stamped, the FFN server's metrics are recorded (`afd.metrics`) and a
failed compute becomes an `internal` error reply: nothing raised by the compute escapes, and
the server keeps serving. The compute itself is pure: (layer, requests) -> outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from afd import metrics
from afd.kernels.moe import InlineExperts
from afd.messages import FFNReply, FFNRequest, Trace
from afd.metric_batches import observe_many
from afd.wire import Buffer, WireError, WireLimits, check_request, decode_request, encode_reply

log = logging.getLogger(__name__)

P = TypeVar("P")

# (layer, that layer's requests) -> one output [T_i, H] per request, in order
Compute = Callable[[int, list[FFNRequest]], list[torch.Tensor]]

DRAINING = "FFN server is draining (shutting down)"
_LOCAL_BATCH = 256  # serve_local calls recorded in the metrics at once


@dataclasses.dataclass(frozen=True)
class Inbound(Generic[P]):
    """One message as a network backend received it."""

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


class FFNServing:
    """What an FFN server does with the messages it receives; one per listener."""

    def __init__(
        self,
        compute: Compute,
        limits: WireLimits,
        device: torch.device | None = None,
        inline_experts: Callable[[int], InlineExperts | None] | None = None,
    ):
        self.compute = compute
        self.limits = limits
        # where `compute` runs, when it is an engine in this process: a caller on the same
        # device hands serve_local its tensors without a copy to the host (afd/device.py)
        self.device = device
        # Set on SIGTERM: every message from then on gets a typed `unavailable` reply, so the
        # attention side moves its work to another replica at once.
        self.draining = False
        # serve_local's (tokens, compute seconds) not yet in the metrics: recorded in batches
        # (flush_local): seven metric updates per layer were ~0.2 ms of a ~15 ms batch-1 step
        self._local: list[tuple[int, float]] = []
        # layer -> its experts as one native call, for a caller in this process that computes
        # the decode step natively instead of sending messages (FFNEngine.inline_experts)
        self.inline_experts = inline_experts

    def serve_frames(self, messages: Sequence[Inbound[P]]) -> list[tuple[P, list[Buffer]]]:
        """Decode (validating), serve and encode; returns (peer, reply frames) for every
        message that gets an answer, in no promised order."""
        received: list[tuple[P, FFNRequest | FFNReply, float]] = []
        for msg in messages:
            try:
                item: FFNRequest | FFNReply = decode_request(msg.frames, self.limits)
            except WireError as e:
                if e.seq is None:
                    log.warning("dropped a malformed FFN message from %r: %s", msg.peer, e)
                    continue
                log.warning("rejected FFN message %d from %r: %s", e.seq, msg.peer, e)
                item = error_reply(e, e.code, e.message)
            received.append((msg.peer, item, msg.t_recv))
        return [(peer, _encode(rep)) for peer, rep in self._serve(received)]

    def serve_requests(
        self, requests: Sequence[tuple[P, FFNRequest, float]]
    ) -> list[tuple[P, FFNReply]]:
        """Serve (peer, request, arrival time) handed over in memory, validated here as the
        network path validates its frames."""
        received: list[tuple[P, FFNRequest | FFNReply, float]] = []
        for peer, req, t_recv in requests:
            try:
                check_request(req, self.limits)
                received.append((peer, req, t_recv))
            except WireError as e:
                log.warning("rejected FFN message %d from %r: %s", req.seq, peer, e)
                received.append((peer, error_reply(req, e.code, e.message), t_recv))
        return self._serve(received)

    def serve_local(self, req: FFNRequest, t_send: float) -> FFNReply:
        """One request from this process's own attention side, computed on the caller's
        thread (an inline in-process shard with one micro-batch: a function call, not a
        message). Not validated: nothing crossed a process boundary, and on this path the checks
        were a visible share of a batch-1 step (docs/benchmarks.md). A failed compute is an
        `internal` error reply, as on every other path; the trace carries the attention side's
        stamps too (a_sent, a_recv), so the telemetry reads it as any reply's."""
        if self.draining:
            return _refused(req, "unavailable", DRAINING, t_send)
        start = time.time()
        code = why = ""
        try:
            (output,) = self.compute(req.layer, [req])
        except Exception as e:  # as on the serving loop: the error goes back, nothing escapes
            log.exception("FFN compute failed on layer %d (in process)", req.layer)
            output, code, why = None, "internal", f"FFN compute failed: {type(e).__name__}: {e}"
        if output is not None and output.shape != req.hidden.shape:
            shape = tuple(output.shape)
            output, code, why = None, "internal", f"output {shape} for {req.num_tokens} tokens"
        end = time.time()
        trace = Trace(
            a_send=t_send, f_recv=t_send, f_compute_start=start, f_compute_end=end,
            f_send=end, a_recv=end, merged=1, a_sent=t_send,
        )  # fmt: skip
        rep = FFNReply(req.seq, req.layer, req.micro_batch, output, code, why, trace)
        if rep.ok and req.num_tokens:
            self._local.append((req.num_tokens, end - start))
            if len(self._local) >= _LOCAL_BATCH:
                self.flush_local()
        elif rep.error_code:
            metrics.FFN_ERRORS.labels(rep.error_code).inc()
        return rep

    def served_inline(self, tokens: int, seconds: Sequence[float]) -> None:
        """The caller computed layers with this shard's kernels itself (inline_experts), one
        layer of `tokens` tokens in each of `seconds`: recorded as serve_local's calls are."""
        if tokens:
            self._local += [(tokens, s) for s in seconds]
            if len(self._local) >= _LOCAL_BATCH:
                self.flush_local()

    def flush_local(self) -> None:
        """Record serve_local's calls since the last flush in the FFN metrics, each as the
        serving loop records a one-message batch. Its caller flushes when it runs out of work."""
        done, self._local = self._local, []
        if not done:
            return
        tokens = [t for t, _ in done]
        metrics.FFN_MESSAGES.inc(len(done))
        metrics.FFN_TOKENS.inc(sum(tokens))
        observe_many(metrics.FFN_BATCH_TOKENS, tokens)
        observe_many(metrics.FFN_BATCH_MESSAGES, [1] * len(done))
        observe_many(metrics.FFN_BATCH_PEERS, [1] * len(done))
        observe_many(metrics.FFN_COMPUTE, [s for _, s in done])
        observe_many(metrics.FFN_QUEUE, [0.0] * len(done))

    def _serve(
        self, received: Sequence[tuple[P, FFNRequest | FFNReply, float]]
    ) -> list[tuple[P, FFNReply]]:
        out: list[tuple[P, FFNReply]] = []
        groups: dict[int, list[tuple[P, FFNRequest, float]]] = {}
        for peer, item, t_recv in received:
            if isinstance(item, FFNReply):  # refused by validation
                out.append((peer, _stamp(item, None, t_recv, (0.0, 0.0), 1)))
            elif self.draining:
                out.append((peer, _refused(item, "unavailable", DRAINING, t_recv)))
            elif item.deadline and t_recv > item.deadline:
                # The sender has given up on it (e.g. it was queued while this server was down).
                why = "arrived after its deadline"
                out.append((peer, _refused(item, "deadline_exceeded", why, t_recv)))
            else:
                groups.setdefault(item.layer, []).append((peer, item, t_recv))
        for layer, group in groups.items():
            out += self._compute(layer, group)
        return out

    def _compute(
        self, layer: int, group: list[tuple[P, FFNRequest, float]]
    ) -> list[tuple[P, FFNReply]]:
        reqs = [req for _, req, _ in group]
        start = time.time()
        try:
            outputs = self.compute(layer, reqs)
            if len(outputs) != len(reqs):
                raise RuntimeError(f"compute gave {len(outputs)} outputs to {len(reqs)} requests")
        except Exception as e:  # a bad batch must not take the server down
            log.exception("FFN compute failed on layer %d (%d requests)", layer, len(reqs))
            outputs = [None] * len(reqs)
            why = f"FFN compute failed: {type(e).__name__}: {e}"
        span = (start, time.time())
        replies = []
        for (peer, req, t_recv), output in zip(group, outputs, strict=True):
            if output is None:
                rep = error_reply(req, "internal", why)
            elif tuple(output.shape) != tuple(req.hidden.shape):
                shape = tuple(output.shape)
                rep = error_reply(req, "internal", f"output {shape} for {req.num_tokens} tokens")
            else:
                rep = FFNReply(req.seq, req.layer, req.micro_batch, output)
            replies.append((peer, _stamp(rep, req, t_recv, span, len(reqs))))
        _observe(group, replies)
        return replies


def _refused(req: FFNRequest, code: str, message: str, t_recv: float) -> FFNReply:
    return _stamp(error_reply(req, code, message), req, t_recv, (0.0, 0.0), 1)


def _stamp(
    rep: FFNReply, req: FFNRequest | None, t_recv: float, span: tuple[float, float], n: int
) -> FFNReply:
    trace = Trace(
        a_send=req.t_send if req is not None else 0.0,
        f_recv=t_recv,
        f_compute_start=span[0],
        f_compute_end=span[1],
        f_send=time.time(),
        merged=n,
    )
    return dataclasses.replace(rep, trace=trace)


def _observe(group: list[tuple[P, FFNRequest, float]], replies: list[tuple[P, FFNReply]]) -> None:
    """One layer call's metrics. Empty messages (the attention side's readiness pings) are
    left out: they would drag every mean towards zero."""
    done = [
        (peer, req, rep)
        for (peer, req, _), (_, rep) in zip(group, replies, strict=True)
        if rep.ok and req.num_tokens
    ]
    for _, rep in replies:
        if rep.error_code:
            metrics.FFN_ERRORS.labels(rep.error_code).inc()
    if not done:
        return
    tr = done[0][2].trace
    tokens = sum(req.num_tokens for _, req, _ in done)
    metrics.FFN_MESSAGES.inc(len(done))
    metrics.FFN_TOKENS.inc(tokens)
    metrics.FFN_BATCH_TOKENS.observe(tokens)
    metrics.FFN_BATCH_MESSAGES.observe(len(done))
    metrics.FFN_BATCH_PEERS.observe(len({peer for peer, _, _ in done}))
    metrics.FFN_COMPUTE.observe(max(0.0, tr.f_compute_end - tr.f_compute_start))
    for _, _, rep in done:
        metrics.FFN_QUEUE.observe(max(0.0, rep.trace.f_compute_start - rep.trace.f_recv))


def _encode(rep: FFNReply) -> list[Buffer]:
    try:
        return encode_reply(rep)
    except WireError as e:  # the compute produced something the wire cannot carry
        log.error("cannot encode the reply to %d: %s", rep.seq, e)
        return encode_reply(
            dataclasses.replace(rep, output=None, error_code="internal", error=str(e))
        )


def stamp_received(reply: FFNReply) -> FFNReply:
    """The attention side's receive stamp (trace.a_recv), taken when the reply is decoded."""
    return dataclasses.replace(reply, trace=dataclasses.replace(reply.trace, a_recv=time.time()))
