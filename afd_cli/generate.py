"""`afd generate`: offline generation, attention and FFN in one process over the in-process
transport (the same engine and FFN server as a deployment; only the transport differs)."""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from afd.config import EngineConfig
from afd.control import SamplingParams
from afd.tokenizer import ModelTokenizer
from afd_cli.local import local_engine

log = logging.getLogger("afd.generate")


@dataclass(frozen=True)
class GenerateJob:
    engine: EngineConfig
    prompts: tuple[str, ...]
    sampling: SamplingParams
    num_ffn: int = 1
    chat: bool = False
    as_json: bool = False


def read_prompts(path: str) -> list[str]:
    """One prompt per line; a JSONL line may be {"prompt": "..."}."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            obj = json.loads(line)
            out.append(str(obj["prompt"]))
        else:
            out.append(line)
    return out


def run(job: GenerateJob) -> int:
    tok = ModelTokenizer(job.engine.model.path)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) if job.chat else p
        for p in job.prompts
    ]
    prompts = [tok.encode(t) for t in texts]
    with local_engine(job.engine, job.num_ffn) as eng:
        t0 = time.perf_counter()
        reqs = eng.generate(prompts, job.sampling)
        dt = time.perf_counter() - t0
    n_out = sum(len(r.output_token_ids) for r in reqs)
    n_in = sum(len(p) for p in prompts)
    results = [
        {
            "prompt": p,
            "text": tok.decode(r.output_token_ids),
            "token_ids": r.output_token_ids,
            "finish_reason": r.finish_reason,
            **({"error": r.error} if r.error else {}),
        }
        for p, r in zip(job.prompts, reqs, strict=True)
    ]
    summary = {
        "requests": len(reqs),
        "prompt_tokens": n_in,
        "generated_tokens": n_out,
        "seconds": round(dt, 3),
        "output_tokens_per_s": round(n_out / dt, 2) if dt > 0 else None,
    }
    if job.as_json:
        json.dump({"results": results, "summary": summary}, sys.stdout, indent=2)
        print()
    else:
        for res in results:
            print(f"--- prompt: {res['prompt']!r}")
            print(res["text"])
            print(f"[{len(res['token_ids'])} tokens, finish_reason={res['finish_reason']}]")
        print(
            f"=== {summary['requests']} requests, {n_in} prompt tokens, {n_out} generated tokens "
            f"in {dt:.2f}s: {summary['output_tokens_per_s']} tokens/s"
        )
    return 1 if any(r.finish_reason == "error" for r in reqs) else 0
