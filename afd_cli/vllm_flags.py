"""`vllm serve` flags that `afd serve` takes, so that a vLLM command line runs as it is.

Each one either sets afd's own setting of the same meaning (`--enable-prefix-caching`,
`--enable-chunked-prefill`, `--data-parallel-size`, `--dtype auto`), or is accepted because afd
already behaves as it asks (`--trust-remote-code`: afd runs no code from a checkpoint;
`--enforce-eager`: afd captures no CUDA graphs), or asks for what afd does not do, and is then an
error that says so (`--tensor-parallel-size 2`: afd does not split a model's tensors). afd's
own flags (`--max-model-len`, `--gpu-memory-utilization`, `--max-num-seqs`, `--served-model-name`,
...) already carry vLLM's names where they mean the same.
"""

from __future__ import annotations

import argparse

from afd.errors import ConfigError
from afd.flags import GIVEN


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's serve flags, taken as they are")
    before = set(map(id, p._actions))
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted: afd runs no code from a checkpoint (its model families are its own)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        dest="vllm_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching on (afd's default) or off (--no-enable-prefix-caching, as "
        "--no-prefix-caching)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        dest="vllm_chunked_prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="chunked prefill on (afd's default) or off (--no-enable-chunked-prefill, as "
        "--no-chunked-prefill)",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        help="as --attention N: N attention servers, each with its own KV cache and batch",
    )
    for flag, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        g.add_argument(
            flag,
            short,
            type=int,
            default=1,
            help="1 only: afd splits a model by role (attention servers, FFN expert shards), "
            "not its tensors or layers",
        )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="as --sampling-seed: the sampler's seed for requests without their own",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="accepted: afd's experts are always split into shards across its FFN servers",
    )
    g.add_argument(
        "--enforce-eager", action="store_true", help="accepted: afd captures no CUDA graphs"
    )
    g.add_argument(
        "--swap-space",
        type=float,
        default=None,
        help="accepted, unused: a preempted request's K/V is recomputed, never swapped out",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted: requests are logged only with --enable-log-requests",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted: afd logs no periodic statistics (its /metrics carry them)",
    )
    g.add_argument(
        "--load-format",
        choices=["auto", "safetensors"],
        default="auto",
        help="accepted: afd loads safetensors checkpoints",
    )
    for action in p._actions:  # filled from no config field: `apply` translates them
        if id(action) not in before:
            action.vllm = True  # type: ignore[attr-defined]


def apply(args: argparse.Namespace) -> None:
    """Turn the vLLM flags given into afd's settings on `args` (before configs are built)."""
    given = getattr(args, GIVEN, None) or set()
    for size, name in (
        (args.tensor_parallel_size, "--tensor-parallel-size"),
        (args.pipeline_parallel_size, "--pipeline-parallel-size"),
    ):
        if size != 1:
            raise ConfigError(
                f"{name} {size}: afd does not split a model's tensors or layers across devices; "
                "it splits by role instead: --attention N attention servers and --ffn M FFN "
                "servers that each hold 1/M of the experts"
            )
    dp = args.data_parallel_size
    if dp is not None:
        if dp < 1:
            raise ConfigError(f"--data-parallel-size must be >= 1, got {dp}")
        if "attention" in given and args.attention != dp:
            raise ConfigError(f"--data-parallel-size {dp} and --attention {args.attention} differ")
        args.attention = dp
        given.add("attention")
    # on/off flags pass on only when off (afd's --no-... flags); a seed whenever given
    if args.vllm_prefix_caching is not None:
        args.enable_prefix_caching = args.vllm_prefix_caching
    if args.vllm_chunked_prefill is not None:
        args.enable_chunked_prefill = args.vllm_chunked_prefill
    if args.seed is not None:
        args.sampling_seed = args.seed
        given.add("sampling_seed")
    setattr(args, GIVEN, given)
