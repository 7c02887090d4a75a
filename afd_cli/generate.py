"""`afd generate`: offline generation, attention and FFN in one process over the in-process
transport (the same engine and FFN server as a deployment; only the transport differs)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from afd import flags
from afd.config import EngineConfig, check
from afd.control import SamplingParams
from afd.errors import ConfigError
from afd.flags import build, option
from afd.tokenizer import ModelTokenizer
from services.attention.flags import add_compute_flags, add_engine_flags, engine_config

log = logging.getLogger("afd.generate")


@dataclass(frozen=True)
class GenerateJob:
    engine: EngineConfig
    prompts: tuple[str, ...]
    num_ffn: int = 1  # in-process FFN expert shards
    chat: bool = False  # wrap each prompt in the chat template
    as_json: bool = False
    # sampling: greedy by default, as offline generation is mostly used to check outputs
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        check(bool(self.prompts), "give at least one --prompt or a --prompts-file")
        check(self.num_ffn >= 1, f"--ffn-shards must be >= 1, got {self.num_ffn}")
        self.sampling  # noqa: B018 - validates the sampling values now, not mid-run

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
        )


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="offline generation (attention + FFN in one process)")
    flags.add_model_flag(p)
    add_compute_flags(p)
    add_engine_flags(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="one prompt per line, or JSONL with a 'prompt' field")
    j = GenerateJob
    option(p, "--chat", j, "chat", help="wrap each prompt in the chat template")
    option(p, "--ffn-shards", j, "num_ffn", help="in-process FFN expert shards")
    g = p.add_argument_group("sampling")
    option(g, "--max-tokens", j, "max_tokens")
    option(g, "--temperature", j, "temperature", help="0: greedy")
    option(g, "--top-p", j, "top_p")
    option(g, "--top-k", j, "top_k", help="0: off")
    option(g, "--seed", j, "seed", type=int)
    option(g, "--ignore-eos", j, "ignore_eos", help="generate max_tokens whatever the model says")
    option(g, "--min-p", j, "min_p", help="0: off")
    option(g, "--min-tokens", j, "min_tokens", help="no EOS or stop token before this many")
    option(g, "--repetition-penalty", j, "repetition_penalty", help="on prompt and output; 1: off")
    option(g, "--frequency-penalty", j, "frequency_penalty", help="per repeat in the output")
    option(g, "--presence-penalty", j, "presence_penalty", help="once per token in the output")
    option(p, "--json", j, "as_json", help="print JSON instead of text")
    return p


def job(args: argparse.Namespace) -> GenerateJob:
    prompts = list(args.prompt) + (read_prompts(args.prompts_file) if args.prompts_file else [])
    return build(GenerateJob, args, engine=engine_config(args), prompts=tuple(prompts))


def read_prompts(path: str) -> list[str]:
    """One prompt per line; a JSONL line may be {"prompt": "..."}."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the prompts file {path!r}: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                out.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{path}:{n}: a JSON line needs a 'prompt' field ({e})") from e
        else:
            out.append(line)
    return out


def run(job: GenerateJob) -> int:
    tok = ModelTokenizer(job.engine.model.path)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) if job.chat else p
        for p in job.prompts
    ]
    # a raw prompt gets the tokenizer's own special tokens (a BOS, for some), as vLLM's
    # LLM.generate gives it; a chat's template writes them itself
    prompts = [tok.encode(t, add_special_tokens=not job.chat) for t in texts]
    from afd_cli.local import local_engine  # torch: only once a generation runs

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
