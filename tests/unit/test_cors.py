"""vLLM's CORS flags on the gateway: by default (vLLM's) a browser page of any origin may call
the API, its preflight answered before the API key is asked for; --allowed-origins narrows it;
`afd serve` passes the lists on in their JSON form."""

from __future__ import annotations

from afd.flags import forward
from afd_cli.main import build_parser
from tests.unit.test_gateway_app import FakeClient, make, run
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture

PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def _send(tokenizer, origin, method="OPTIONS", **cfg):
    async def go():
        async with make(tokenizer, [FakeClient()], api_key="k", **cfg) as c:
            if method == "OPTIONS":
                return await c.options("/v1/completions", headers={"Origin": origin, **PREFLIGHT})
            return await c.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                headers={"Origin": origin, "Authorization": "Bearer k"},
            )

    return run(go())


def test_any_origin_by_default_and_the_preflight_needs_no_key(tokenizer):
    r = _send(tokenizer, "https://app.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = _send(tokenizer, "https://app.example", method="POST")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_narrow_it(tokenizer):
    only = {"allowed_origins": ("https://app.example",)}
    r = _send(tokenizer, "https://app.example", **only)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = _send(tokenizer, "https://evil.example", **only)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = _send(tokenizer, "https://evil.example", method="POST", **only)
    assert "access-control-allow-origin" not in r.headers


def test_the_lists_are_json_on_the_command_line_and_passed_on_so():
    parser = build_parser()
    args = parser.parse_args(["serve", "--allowed-origins", '["https://a.example", "http://b"]'])
    assert args.allowed_origins == ("https://a.example", "http://b")
    passed = forward(args, args.api_actions)
    assert passed == ["--allowed-origins", '["https://a.example", "http://b"]']
    child = parser.parse_args(["gateway", "--attention", "x:1", *passed])
    assert child.allowed_origins == args.allowed_origins
