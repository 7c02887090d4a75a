"""vLLM's several served model names: a request may use any, responses carry the first, and
/v1/models lists each."""

from __future__ import annotations

import pytest

from afd.errors import ConfigError
from services.gateway.config import GatewayConfig
from tests.unit.test_gateway_app import FakeClient, make, post, run
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture


def test_every_name_is_served_and_answers_carry_the_first(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient(context=4096)], model_aliases=("gpt-4o",)) as c:
            body = {"prompt": "hi", "max_tokens": 2}
            return (
                await post(c, "/v1/completions", {**body, "model": "gpt-4o"}),
                await post(c, "/v1/completions", {**body, "model": "m"}),
                await post(c, "/v1/completions", {**body, "model": "other"}),
                (await c.get("/v1/models")).json(),
                (await c.get("/v1/models/gpt-4o")).json(),
                await c.get("/v1/models/other"),
            )

    alias, own, other, listed, card, missing = run(go())
    assert alias.status_code == own.status_code == 200
    assert alias.json()["model"] == own.json()["model"] == "m"
    assert other.status_code == 404 or other.status_code == 400
    assert "'m' or 'gpt-4o'" in other.json()["error"]["message"]
    assert [m["id"] for m in listed["data"]] == ["m", "gpt-4o"] and card["id"] == "gpt-4o"
    assert missing.status_code in (400, 404)


def test_names_must_differ_and_be_given():
    for aliases in (("m",), ("",)):
        with pytest.raises(ConfigError):
            GatewayConfig("d", ("a:1",), "m", model_aliases=aliases)
