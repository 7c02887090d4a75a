"""A real control-plane server (the attention server's servicer on a gRPC port) around a
stand-in for the engine loop, for the Session's tests and the control plane's benchmark."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import grpc

from afd.control import SamplingParams, TokenEvent, pb_grpc
from afd_cli.procs import free_port  # noqa: F401 - re-exported to the tests
from services.attention.server import ControlServicer


class SteppingLoop:
    """Stands in for `EngineLoop`: once `start_when` requests are live, every `step_s` each
    live request gets one token (its position), and the last one finishes it ("length")."""

    def __init__(self, start_when: int = 1, step_s: float = 0.01):
        self.start_when = start_when
        self.step_s = step_s
        self.aborted: list[str] = []
        self._live: dict[str, list] = {}  # rid -> [sink, tokens so far, max_tokens]
        self._lock = threading.Lock()
        self._started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def submit(self, rid: str, prompt: list[int], sampling: SamplingParams, sink) -> None:
        with self._lock:
            self._live[rid] = [sink, 0, sampling.max_tokens]

    def abort(self, rid: str) -> Future:
        with self._lock:
            item = self._live.pop(rid, None)
        if item is not None:
            self.aborted.append(rid)
            item[0](TokenEvent(rid, [], finish_reason="abort"))
        fut: Future = Future()
        fut.set_result(item is not None)
        return fut

    def _run(self) -> None:
        while not self._stop.wait(self.step_s):
            with self._lock:
                self._started = self._started or len(self._live) >= self.start_when
                if not self._started:
                    continue
                for rid, item in list(self._live.items()):
                    sink, n, most = item
                    item[1] = n + 1
                    done = n + 1 >= most
                    if done:
                        del self._live[rid]
                    sink(TokenEvent(rid, [n], finish_reason="length" if done else ""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class CountingServicer(ControlServicer):
    """Records how many events each Session message carried."""

    def __init__(self, loop, cfg):
        super().__init__(loop, cfg)
        self.messages: list[int] = []

    async def Session(self, request_iterator, context):  # noqa: N802 - gRPC's method name
        async for msg in super().Session(request_iterator, context):
            self.messages.append(len(msg.events))
            yield msg


class GenerateOnlyServicer(ControlServicer):
    """A server from before Session: the generated base class answers UNIMPLEMENTED."""

    Session = pb_grpc.AttentionServiceServicer.Session


async def start_server(servicer: ControlServicer, addr: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_AttentionServiceServicer_to_server(servicer, server)
    server.add_insecure_port(addr)
    await server.start()
    return server


def servicer(loop: SteppingLoop, addr: str, kind=CountingServicer) -> ControlServicer:
    return kind(loop, SimpleNamespace(listen=addr, ready_cache_s=1.0, model_name="m"))
