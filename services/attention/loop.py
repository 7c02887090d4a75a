"""The engine loop: one thread that owns the Engine and runs schedule -> execute -> update.

Other threads (the control-plane server) talk to it only through `submit` and `abort`; each
request's events go to the `sink` given with it, called on the engine thread. The optional
telemetry records the server's metrics on this thread after each step (and refreshes its
gauges while idle).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from afd.control import SamplingParams, Stats, TokenEvent
from afd.errors import ErrorCode, RequestError
from services.attention.engine import Engine, StepResult
from services.attention.request import Request

log = logging.getLogger("afd.attention")


Sink = Callable[[TokenEvent], None]
_IDLE_WAIT_S = 0.5  # idle: how long to wait for a command before the FFN pool's upkeep
_PAUSED_WAIT_S = 0.05  # paused for the FFN pool: how often to look at its probes again


class Telemetry(Protocol):
    def after_step(self, result: StepResult, seconds: float, load: Stats) -> None: ...

    def idle(self, load: Stats) -> None: ...


class EngineLoop:
    def __init__(self, engine: Engine, telemetry: Telemetry | None = None):
        self.engine = engine
        self.telemetry = telemetry
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._sent: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt: list[int], sampling: SamplingParams, sink: Sink):
        self._cmds.put(("add", request_id, prompt, sampling, sink))

    def abort(self, request_id: str) -> Future:
        """Abort on the engine thread; the future says whether the request was still there
        (False for an unknown or finished one)."""
        fut: Future = Future()
        self._cmds.put(("abort", request_id, fut))
        return fut

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread between steps (the transports are not thread-safe)."""
        fut: Future = Future()
        self._cmds.put(("call", fn, fut))
        return fut

    def close(self) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(0.0 if self.engine.has_unfinished() else _IDLE_WAIT_S)
            if self.engine.has_unfinished():
                try:
                    t0 = time.perf_counter()
                    result = self.engine.step()
                    seconds = time.perf_counter() - t0
                    self._publish(result.requests)
                except Exception as e:  # a broken step must not kill the server
                    log.exception("engine step failed")
                    self._fail_all(f"internal error: {e}")
                    continue
                if self.telemetry is not None:
                    self.telemetry.after_step(result, seconds, self.engine.load())
                if result.paused:  # waiting for the FFN pool: look again soon, without spinning
                    self._drain(_PAUSED_WAIT_S)
            else:
                self._idle()

    def _idle(self) -> None:
        try:
            self.engine.maintain_ffn()  # take back FFN replicas that were marked down
        except Exception:
            log.exception("probing the FFN pool failed")
        if self.telemetry is not None:
            self.telemetry.idle(self.engine.load())

    def _drain(self, wait: float) -> None:
        """Apply the commands queued; with `wait`, wait up to that long for the first."""
        try:
            cmd = self._cmds.get(timeout=wait) if wait > 0 else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                self._apply(cmd)
            except Exception:  # one bad command must not take the engine thread down
                log.exception("engine command %r failed", cmd[0])
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, sampling, sink = cmd
            try:
                self.engine.add_request(prompt, sampling, request_id=rid)
            except RequestError as e:
                sink(TokenEvent.failure(rid, e.code, str(e)))
                return
            self._sinks[rid] = sink
            self._sent[rid] = 0
        elif cmd[0] == "call":
            _, fn, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return  # its caller gave up waiting (a cancelled RPC): nothing to run
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)
        elif cmd[0] == "abort":
            _, rid, fut = cmd
            found = self.engine.abort(rid)  # unknown or finished ids are ignored
            if found:
                self._emit_final(rid, TokenEvent(rid, [], finish_reason="abort"))
            fut.set_result(found)

    def _publish(self, updated: list[Request]) -> None:
        for req in updated:
            rid = req.request_id
            sink = self._sinks.get(rid)
            if sink is None:
                continue
            n = self._sent[rid]
            new = req.output_token_ids[n:]
            self._sent[rid] = len(req.output_token_ids)
            queued = (req.first_scheduled_time or req.arrival_time) - req.arrival_time
            ev = TokenEvent(
                rid,
                new,
                req.output_logprobs[n:],
                finish_reason=(req.finish_reason or "") if req.finished else "",
                error_code=req.error_code,
                error=req.error,
                prompt_tokens=req.num_prompt_tokens,
                completion_tokens=len(req.output_token_ids),
                queue_seconds=queued if n == 0 else 0.0,
                prompt_logprobs=req.prompt_logprobs if n == 0 else [],
                cached_tokens=req.num_cached_tokens or 0,
                stop_token=req.finished and req.stop_token,
            )
            if req.finished:
                self._emit_final(rid, ev)
            else:
                sink(ev)

    def _emit_final(self, rid: str, ev: TokenEvent) -> None:
        sink = self._sinks.pop(rid, None)
        self._sent.pop(rid, None)
        if sink is not None:
            sink(ev)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._sinks):
            self.engine.abort(rid)
            self._emit_final(rid, TokenEvent.failure(rid, ErrorCode.INTERNAL, message))
