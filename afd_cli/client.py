"""`afd chat` and `afd complete`: clients of a running server (`afd serve`, or any OpenAI
API), as `vllm chat` and `vllm complete` are. A chat keeps its conversation; each line typed
is the next user message (or, for `complete`, a prompt), and the answer streams as it comes.
`-q MESSAGE` asks once and exits (a failure: one line, status 2); in a conversation a failed
message is said and left out, and the status is 1 at the end. The API key comes from
--api-key, AFD_API_KEY or OPENAI_API_KEY."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import httpx

from afd.errors import AfdError

DEFAULT_URL = "http://localhost:8000/v1"


WHAT = {
    "chat": "chat with a running server (its conversation kept)",
    "complete": "complete prompts with a running server",
}


def add_parser(sub, name: str) -> None:
    """`afd chat` or `afd complete`."""
    p = sub.add_parser(name, help=WHAT[name])
    p.add_argument("--url", default=DEFAULT_URL, help="the server's API base URL")
    p.add_argument("--model-name", help="the model (default: the first the server lists)")
    p.add_argument("--api-key", help="the server's API key (default: $AFD_API_KEY)")
    p.add_argument("--max-tokens", type=int, help="tokens per answer, at most")
    p.add_argument("--temperature", type=float, help="sampling temperature")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per answer")
    p.add_argument("-q", "--quick", metavar="TEXT", help="ask once, print the answer, exit")
    if name == "chat":
        p.add_argument("--system-prompt", help="the conversation's system message")
    p.set_defaults(func=run, chat=name == "chat")


def run(args: argparse.Namespace) -> int:
    stdin, out = sys.stdin, sys.stdout
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: noise here
    key = args.api_key or os.environ.get("AFD_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = args.url.rstrip("/")
    with httpx.Client(base_url=url, headers=headers, timeout=args.timeout) as http:
        model = args.model_name or _first_model(http, url)
        messages: list[dict[str, str]] = []
        if args.chat and args.system_prompt:
            messages.append({"role": "system", "content": args.system_prompt})
        once = args.quick is not None
        failed = False
        for line in [args.quick] if once else _lines(stdin, out):
            body: dict[str, Any] = {"model": model, "stream": True}
            body |= {k: v for k in ("max_tokens", "temperature")
                     if (v := getattr(args, k)) is not None}  # fmt: skip
            if args.chat:
                messages.append({"role": "user", "content": line})
                body["messages"] = messages
            else:
                body["prompt"] = line
            path = "/chat/completions" if args.chat else "/completions"
            try:
                answer = _stream(http, url, path, body, out)
            except AfdError as e:
                if once:
                    raise
                # one message failed (too long, say): said, and the conversation goes on
                print(f"error: {e}", file=sys.stderr)
                failed = True
                messages = messages[:-1]
                continue
            if args.chat:
                messages.append({"role": "assistant", "content": answer})
    return 1 if failed else 0


def _lines(stdin: TextIO, out: TextIO) -> Iterator[str]:
    interactive = stdin.isatty()
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = stdin.readline()
        if not line:  # end of input (Ctrl-D)
            return
        if line.strip():
            yield line.rstrip("\n")


def _first_model(http: httpx.Client, url: str) -> str:
    models = _json(_call(http, url, "GET", "/models"))
    data = models.get("data") if isinstance(models, dict) else None
    if not data:
        raise AfdError(f"the server at {url} lists no model; name one with --model-name")
    return data[0]["id"]


def _stream(http: httpx.Client, url: str, path: str, body: dict, out: TextIO) -> str:
    """POST a streamed request and write each piece of text as it comes; the whole text."""
    pieces: list[str] = []
    try:
        with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                raise AfdError(f"the server answered {r.status_code}: {_message(r)}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # the stream's own error event
                    raise AfdError(f"the server failed mid-answer: {event['error']['message']}")
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if text:
                        pieces.append(text)
                        out.write(text)
                        out.flush()
    except httpx.HTTPError as e:
        raise AfdError(f"cannot reach the server at {url}: {e}") from None
    out.write("\n")
    return "".join(pieces)


def _call(http: httpx.Client, url: str, method: str, path: str) -> httpx.Response:
    try:
        r = http.request(method, path)
    except httpx.HTTPError as e:
        raise AfdError(f"cannot reach the server at {url}: {e}") from None
    if r.status_code != 200:
        raise AfdError(f"the server answered {r.status_code}: {_message(r)}")
    return r


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        raise AfdError(f"the server answered other than JSON: {r.text[:200]!r}") from None


def _message(r: httpx.Response) -> str:
    """An error answer's message (an OpenAI error body's), else its text."""
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200] or r.reason_phrase
