"""The HTTP API fuzzed from its own OpenAPI document (/openapi.json): request bodies generated
from each operation's schema, the same with one field replaced by arbitrary JSON, arbitrary
JSON and raw bytes, plus arbitrary model names in paths. Nothing may answer 5xx (other than a
documented 503/504) or break the error format; afterwards the gateway still serves. Run
against fake attention servers here (many examples, no processes); test_faults.py runs a
smaller set against the real cluster.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from afd.demo import write_tokenizer
from afd.tokenizer import ModelTokenizer
from tests.unit.test_gateway_app import FakeClient, make

pytest.importorskip("hypothesis_jsonschema")
from hypothesis_jsonschema import from_schema  # noqa: E402

EXAMPLES = 120  # per operation; HYPOTHESIS_PROFILE-free on purpose: the CI bound is this
DOCUMENTED = {200, 400, 401, 404, 413, 429, 503, 504}
# One body per operation that must be served (200), tried on every run beside the generated
# ones: the schema cannot say "exactly one of prompt or messages", so a run of generated bodies
# may hold no valid one at all.
VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104, 105]},
}

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def body_strategy(spec: dict, path: str):
    """Bodies for one POST operation: schema-valid, one field mutated, arbitrary."""
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    doc = {**schema, "components": spec["components"]}
    model = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    fields = sorted(model.get("properties", {}))
    valid = from_schema(doc)
    mutated = st.builds(
        lambda body, key, value: {**body, key: value} if isinstance(body, dict) else body,
        valid,
        st.sampled_from(fields),
        JSON,
    )
    encode = st.builds(lambda v: json.dumps(v).encode(), valid | mutated | JSON)
    return encode | st.binary(max_size=64)


class Loop:
    """An event loop on a thread holding one ASGI client, so every example reuses them."""

    def __init__(self, make_client):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.client = self.run(self._enter(make_client))

    async def _enter(self, make_client):
        client = make_client()
        return await client.__aenter__()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.run(self.client.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    tok = ModelTokenizer(d)
    loop = Loop(lambda: make(tok, [FakeClient("fake:1"), FakeClient("fake:2", load=1)]))
    yield loop
    loop.close()


# how a Responses API stream ends (it has no [DONE]: OpenAI's streams end on one of these)
RESPONSE_ENDS = {"response.completed", "response.incomplete", "response.failed", "error"}


def check(r: httpx.Response, what, path: str = "") -> None:
    assert r.status_code in DOCUMENTED, (what, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], what
    elif "text/event-stream" in r.headers.get("content-type", "") and path == "/v1/responses":
        last = r.text.rstrip().rsplit("\n", 1)[-1]
        assert last.startswith("data: {"), (what, r.text[-200:])
        assert json.loads(last[6:])["type"] in RESPONSE_ENDS, (what, r.text[-200:])
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert r.text.rstrip().endswith("data: [DONE]"), (what, r.text[-200:])


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"],
)
def test_fuzzed_bodies_never_5xx(gateway, path):
    spec = gateway.run(gateway.client.get("/openapi.json")).json()
    statuses: Counter = Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @example(json.dumps(VALID[path]).encode())
    @given(body_strategy(spec, path))
    def one(body: bytes):
        headers = {"content-type": "application/json"}
        r = gateway.run(gateway.client.post(path, content=body, headers=headers))
        statuses[r.status_code] += 1
        check(r, body[:200], path)

    one()
    print(f"\nfuzz {path}: statuses {dict(statuses)}")
    assert statuses[400] and statuses[200], statuses
    r = gateway.run(gateway.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}))
    assert r.status_code == 200  # still serving


@settings(max_examples=60, deadline=None, database=None)
@given(name=st.text(min_size=1, max_size=30))
def test_fuzzed_paths_never_5xx(gateway, name):
    r = gateway.run(gateway.client.get(f"/v1/models/{quote(name, safe='')}"))
    check(r, name)


@settings(max_examples=60, deadline=None, database=None)
@given(
    # an id is one path segment ("/" would make another route's path, answered by its rules,
    # and so would "." and "..", which the client folds away: "/v1/responses/." is a POST-only
    # route's path)
    name=st.text(
        st.characters(blacklist_characters="/", codec="utf-8"), min_size=1, max_size=30
    ).filter(lambda s: s not in (".", "..")),
    query=st.dictionaries(
        st.sampled_from(["limit", "order", "after", "stream", "include"]),
        st.text(max_size=12),
        max_size=3,
    ),
    real=st.booleans(),
)
def test_fuzzed_stored_response_calls_never_5xx(gateway, name, query, real):
    """Stored-response calls on arbitrary ids and query strings, and on a stored one's."""
    if real:
        made = gateway.run(gateway.client.post("/v1/responses", json=VALID["/v1/responses"]))
        name = made.json()["id"]
    at = f"/v1/responses/{quote(name, safe='')}"
    c = gateway.client
    for call in (
        lambda: c.get(at, params=query),
        lambda: c.get(at + "/input_items", params=query),
        lambda: c.post(at + "/cancel"),
        lambda: c.delete(at),
    ):
        check(gateway.run(call()), (name, query))
