"""vLLM's --chat-template and --generation-config: a template file (or text) in place of the
model's, and the sampling defaults of a generation_config.json for the fields a request leaves
out (a field the request gives, even at the API's own default, wins); bad values refused at
start-up with one line."""

from __future__ import annotations

import json

import httpx
import pytest

from afd.demo import write_tokenizer
from afd.errors import ConfigError
from services.gateway.app import GatewayConfig, build_state, create_app
from services.gateway.balancer import Balancer
from services.gateway.detok import TokenBytes
from services.gateway.handlers import GatewayState
from services.gateway.model_defaults import chat_template, sampling_defaults
from tests.helpers import checkpoints
from tests.unit.test_gateway_app import FakeClient, post, run
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture

GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
              "max_new_tokens": 5, "eos_token_id": 1}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = checkpoints.qwen3_moe(tmp_path_factory.mktemp("defaults") / "ckpt")
    write_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


def test_sampling_defaults_come_from_the_generation_config(model_dir, tmp_path):
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5}
    assert sampling_defaults("auto", str(model_dir)) == want
    assert sampling_defaults("vllm", str(model_dir)) == {}
    assert sampling_defaults("auto", str(tmp_path)) == {}  # a model without one
    with pytest.raises(ConfigError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path), str(model_dir))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ConfigError, match="temperature must be >= 0"):
        sampling_defaults(str(tmp_path), str(model_dir))


def test_chat_template_from_a_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}!")
    assert chat_template(str(f)) == "{{ messages[0]['content'] }}!"
    assert chat_template("{% for m in messages %}x{% endfor %}").startswith("{%")
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        chat_template(str(tmp_path / "missing.jinja"))


def test_the_gateway_starts_with_both(model_dir, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("[{{ messages[0]['content'] }}]")
    cfg = GatewayConfig(str(model_dir), ("127.0.0.1:1",), "m", chat_template=str(f))
    state = build_state(cfg)
    assert state.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    assert state.sampling_defaults["temperature"] == 0.6


def test_requests_take_the_defaults_for_what_they_leave_out(tokenizer):
    fake = FakeClient(context=64)
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 5}

    async def go(body):
        state = GatewayState(tokenizer, TokenBytes(tokenizer), Balancer([fake]), "m", 320,
                             sampling_defaults=defaults)  # fmt: skip
        app = create_app(state, GatewayConfig("unused", ("fake:1",), "m"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            msgs = [{"role": "user", "content": "x"}]
            return await post(c, "/v1/chat/completions", {"messages": msgs, **body})

    assert run(go({})).status_code == 200
    sp = fake.calls[-1][2]
    assert (sp.temperature, sp.top_k, sp.max_tokens, sp.top_p) == (0.6, 20, 5, 1.0)
    assert run(go({"temperature": 1.0, "max_tokens": 7})).status_code == 200
    sp = fake.calls[-1][2]
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (1.0, 20, 7)  # given wins
