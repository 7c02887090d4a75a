"""`afd bench serve`: a load generator for any OpenAI-compatible endpoint (afd or not).

    afd bench serve --base-url http://127.0.0.1:8000/v1 --num-requests 200 --concurrency 16 \
        --input-len 128 --output-len 64 --ignore-eos --sla-ttft 0.5 --sla-tpot 0.05

Requests stream (SSE) from /v1/completions or /v1/chat/completions, either at a fixed
concurrency or arriving as a Poisson process (`--request-rate`, optionally capped by
`--concurrency`). Prompts are synthetic, of a given token length (measured with the server's
/tokenize when it has one, else approximated with words), optionally after one of
`--shared-prefixes` shared "system prompts" of `--shared-prefix-len` tokens (what a prefix
cache is for), or read from a JSONL file. Reported,
as vLLM's `bench serve` and DistServe define them:

- TTFT: send to the first streamed token; E2E: send to the last byte of the stream;
- TPOT per request: (E2E - TTFT) / (output tokens - 1);
- ITL: gap between consecutive streamed chunks, split evenly over the tokens of a chunk when the
  chunk says how many (with --logprobs every token is counted, else one token per chunk);
- throughput: requests and tokens per second over the run; goodput: requests per second that
  met every SLA given. Output tokens come from the stream's usage when the server reports it;
- the prompt tokens the server's prefix cache supplied (`prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from afd.errors import AfdError
from afd_cli.bench.serve_report import Result, summarize, table

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact river stone cloud garden window "
    "music letter paper engine signal market orange silver winter summer morning evening"
).split()


@dataclass(frozen=True)
class Prompt:
    body: dict  # the request body without model/stream fields
    prompt_tokens: int  # as prepared (0: unknown)


# ------------------------------------------------------------------ prompts


def _root(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class Tokenizer:
    """The server's /tokenize and /detokenize, if it has them. afd and vLLM take
    {"prompt": text} and answer {"tokens": [...]} / {"prompt": text}; llama.cpp's server takes
    {"content": text} and answers {"tokens": [...]} / {"content": text}. The first form that
    returns tokens for a non-empty text is kept; with neither, prompts are approximated with
    words (a warning says so)."""

    FORMS = ("prompt", "content")

    def __init__(self, http, root: str):
        self.http, self.root = http, root
        self.form: str | None = None  # the request key that works
        self.absent = False

    async def tokenize(self, text: str) -> list[int] | None:
        if self.absent:
            return None
        for form in (self.form,) if self.form else self.FORMS:
            try:
                r = await self.http.post(f"{self.root}/tokenize", json={form: text})
                tokens = r.json().get("tokens") if r.status_code == 200 else None
            except Exception:  # no /tokenize (a plain OpenAI endpoint), or not JSON
                tokens = None
            if isinstance(tokens, list) and (tokens or not text):
                self.form = form
                return [t if isinstance(t, int) else t.get("id", 0) for t in tokens]
        if self.form is None:
            self.absent = True
            print(
                f"warning: {self.root}/tokenize gave no tokens; prompt lengths are approximated "
                "with words",
                file=sys.stderr,
            )
        return None

    async def detokenize(self, ids: list[int]) -> str | None:
        try:
            r = await self.http.post(f"{self.root}/detokenize", json={"tokens": ids})
            body = r.json() if r.status_code == 200 else {}
        except Exception:
            return None
        text = body.get(self.form or "prompt")
        return text if isinstance(text, str) else None


# Rounds of words added to a text that tokenized short, before taking it as it is.
_GROW_ATTEMPTS = 8


async def _synthetic_text(tok: Tokenizer, rng: random.Random, n_tokens: int) -> tuple[str, int]:
    """Text of about `n_tokens` tokens: (text, measured tokens or 0 if the server cannot say)."""
    # A random number first: no two prompts share a prefix (a prefix cache would flatter TTFT).
    words = [str(rng.randrange(10**6))] + [rng.choice(_WORDS) for _ in range(n_tokens)]
    text = " ".join(words)
    ids = await tok.tokenize(text)
    if ids is None:
        return " ".join(words[: max(1, n_tokens)]), 0
    for _ in range(_GROW_ATTEMPTS):  # rare: fewer tokens than words
        if len(ids) >= n_tokens:
            break
        text += " " + " ".join(rng.choice(_WORDS) for _ in range(n_tokens - len(ids)))
        ids = await tok.tokenize(text) or ids
    cut = await tok.detokenize(ids[:n_tokens])
    if cut is None:
        return text, len(ids)
    again = await tok.tokenize(cut)
    return cut, len(again) if again is not None else n_tokens


def _body(args: argparse.Namespace, text: str | None, messages: list | None, out: int) -> dict:
    body: dict = {"max_tokens": out, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = messages or [{"role": "user", "content": text or ""}]
        if args.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = args.logprobs
    else:
        body["prompt"] = text if text is not None else _flatten(messages or [])
        if args.logprobs is not None:
            body["logprobs"] = args.logprobs
    return body


def _flatten(messages: list) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))


def _read_jsonl(path: str, args: argparse.Namespace) -> list[Prompt]:
    """One JSON object per line: {"prompt": str} or {"messages": [...]}, optionally
    "max_tokens" or "output_len"."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise AfdError(f"{path}:{i}: not JSON: {e}") from None
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise AfdError(f"{path}:{i}: expected an object with 'prompt' or 'messages'")
        n = int(row.get("max_tokens") or row.get("output_len") or args.output_len)
        out.append(Prompt(_body(args, row.get("prompt"), row.get("messages"), n), 0))
    if not out:
        raise AfdError(f"{path} has no prompts")
    return out


async def prepare_prompts(http, args: argparse.Namespace) -> list[Prompt]:
    if args.dataset:
        rows = _read_jsonl(args.dataset, args)
        return [rows[i % len(rows)] for i in range(args.num_requests)]
    rng = random.Random(args.seed)
    tok = Tokenizer(http, _root(args.base_url))
    shared = [
        await _synthetic_text(tok, rng, args.shared_prefix_len)
        for _ in range(args.shared_prefixes if args.shared_prefix_len else 0)
    ]
    prompts = []
    for _ in range(args.num_requests):
        text, n = await _synthetic_text(tok, rng, args.input_len)
        if shared:
            # each question after a system prompt drawn at random: in order, one prompt in k
            # would fall on the same server of a round-robin pool every time
            system, m = shared[rng.randrange(len(shared))]
            text, n = f"{system}\n{text}", n + m if n and m else 0
        prompts.append(Prompt(_body(args, text, None, args.output_len), n))
    return prompts


# ------------------------------------------------------------------ one request


def _chunk_tokens(choice: dict, chat: bool) -> int:
    """Tokens in one streamed choice chunk: from its logprobs when present, else one per chunk
    (servers stream a chunk per token, as vLLM does, even when its text is empty), except a
    closing chunk that carries only the finish reason."""
    lp = choice.get("logprobs")
    if lp:
        return len(lp.get("content") or []) if chat else len(lp.get("tokens") or [])
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return 1 if text or not choice.get("finish_reason") else 0


async def _one(http, url: str, body: dict, chat: bool) -> Result:
    res = Result(ok=False)
    t0 = time.perf_counter()
    last = t0
    counted = 0
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"].get("message", ev["error"]))[:200]
                    return res
                if ev.get("usage"):
                    res.prompt_tokens = ev["usage"].get("prompt_tokens", 0)
                    res.output_tokens = ev["usage"].get("completion_tokens", 0)
                    details = ev["usage"].get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                k = sum(_chunk_tokens(c, chat) for c in ev.get("choices") or [])
                if not k:
                    continue
                now = time.perf_counter()
                if not counted:
                    res.ttft = now - t0
                else:
                    res.itl += [(now - last) / k] * k
                counted += k
                last = now
    except Exception as e:  # a broken connection is a failed request, not a crashed run
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or counted
    res.ok = counted > 0
    if not res.ok:
        res.error = "the stream carried no tokens"
    return res


# ------------------------------------------------------------------ the run


async def run_async(args: argparse.Namespace) -> dict:
    """The whole run; returns the summary (see `summarize`)."""
    import httpx
    from tqdm import tqdm

    if args.shared_prefix_len < 0 or args.shared_prefixes < 1:
        raise AfdError("--shared-prefix-len must be >= 0 and --shared-prefixes >= 1")
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1:
        raise AfdError("--num-requests, --input-len and --output-len must be >= 1")
    if args.concurrency < 0 or args.request_rate < 0:
        raise AfdError("--concurrency and --request-rate must be >= 0")
    if not args.concurrency and not args.request_rate:
        args.concurrency = 1  # neither given: one request at a time

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chat = args.endpoint == "chat"
    url = args.base_url.rstrip("/") + ("/chat/completions" if chat else "/completions")
    limit = args.concurrency or args.num_requests
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as http:
        model = args.model or await _default_model(http, args.base_url)
        prompts = await prepare_prompts(http, args)
        extra = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        sem = asyncio.Semaphore(limit)
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.no_progress)
        rng = random.Random(args.seed + 1)

        async def fire(p: Prompt) -> Result:
            async with sem:
                res = await _one(http, url, {**p.body, **extra}, chat)
            res.prompt_tokens = res.prompt_tokens or p.prompt_tokens
            bar.update(1)
            return res

        # The objects alive now (this process imported torch and afd to parse its command
        # line) stay alive: frozen, a full collection during the timed run need not walk them,
        # which otherwise lands ~100 ms pauses in whichever request is in flight.
        gc.collect()
        gc.freeze()
        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(fire(p)))
            if args.request_rate and not math.isinf(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return summarize(results, duration, args, model)


async def _default_model(http, base_url: str) -> str:
    r = await http.get(base_url.rstrip("/") + "/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise AfdError(f"{base_url}/models lists no model: give --model")
    return data[0]["id"]


def run(args: argparse.Namespace) -> int:
    summary = asyncio.run(run_async(args))
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2) if args.json else table(summary), flush=True)
    return 0 if summary["completed"] else 1


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Register `afd bench serve` on the bench subparsers; sets func."""
    p = bench_subparsers.add_parser(
        "serve",
        help="load generator for an OpenAI-compatible endpoint: TTFT, TPOT, ITL, goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the API's /v1 URL")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY") or os.environ.get("AFD_API_KEY", ""),
        help="bearer key (default: $OPENAI_API_KEY or $AFD_API_KEY)",
    )
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument(
        "--concurrency", type=int, default=0, help="requests in flight at most (0: no cap)"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals per second (0: all at once, limited by --concurrency)",
    )
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens")
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="synthetic prompts: a shared 'system prompt' of this many tokens before each",
    )
    p.add_argument(
        "--shared-prefixes",
        type=int,
        default=1,
        help="... one of this many distinct ones, drawn at random for each prompt",
    )
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--dataset", help="JSONL: {'prompt': ...} or {'messages': [...]} per line")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--logprobs",
        type=int,
        help="ask for logprobs (top K): every token is then counted as it streams",
    )
    p.add_argument("--sla-ttft", type=float, default=0.0, help="TTFT SLA, s (0: none)")
    p.add_argument("--sla-tpot", type=float, default=0.05, help="TPOT SLA, s (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, s")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--output", help="also write the JSON summary to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="afd bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    a = parser.parse_args(sys.argv[1:])
    sys.exit(a.func(a))
