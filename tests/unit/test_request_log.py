"""vLLM's request logging: off by default; on, one line per request (prompt, parameters that
differ from the defaults) and, with outputs, one per finished choice, clipped to
--max-log-len; whole answers and streams alike."""

from __future__ import annotations

import logging

import pytest

from afd.errors import ConfigError
from services.gateway.config import GatewayConfig
from tests.unit.test_gateway_app import FakeClient, make, post, run
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture

BODY = {"prompt": "the weather in Oslo", "max_tokens": 4, "n": 2, "temperature": 0.5}


def _logged(tokenizer, caplog, stream: bool = False, **cfg) -> list[str]:
    async def go():
        async with make(tokenizer, [FakeClient(context=4096, text="Sunny")], **cfg) as c:
            r = await post(c, "/v1/completions", {**BODY, "stream": stream},
                           headers={"X-Request-Id": "req-7"})  # fmt: skip
            assert r.status_code == 200, r.text

    with caplog.at_level(logging.INFO, logger="afd.gateway.requests"):
        run(go())
    return [r.getMessage() for r in caplog.records if r.name == "afd.gateway.requests"]


def test_off_by_default(tokenizer, caplog):
    assert _logged(tokenizer, caplog) == []


@pytest.mark.parametrize("stream", [False, True])
def test_requests_and_outputs_are_logged_clipped(tokenizer, caplog, stream):
    lines = _logged(tokenizer, caplog, stream, log_requests=True, log_outputs=True, max_log_len=7)
    request, *outputs = lines
    assert request.startswith("request req-7: prompt of ") and "'the wea'" in request
    assert "2 choice(s)" in request and "temperature=0.5" in request
    assert "max_tokens=4" in request and "top_p" not in request  # only what differs
    assert len(outputs) == 2
    for line in outputs:
        assert line.startswith("output of req-7.") and line.endswith(
            ": 'Sunn', finish length, 4 tokens"
        )


def test_outputs_alone_are_refused():
    with pytest.raises(ConfigError, match="needs --enable-log-requests"):
        GatewayConfig("d", ("a:1",), "m", log_outputs=True)
