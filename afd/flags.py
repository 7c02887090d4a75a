"""Command-line flags declared from the config dataclasses they fill.

A flag is declared once, against the field it sets: `option(group, "--ffn-timeout",
EngineConfig, "ffn_timeout_s", help=...)`. Its default is the field's default (so the two can
never drift), its type follows that default, its value lands in `args.<field name>`, and the
action remembers the field (`action.field`), which is how `build` fills a dataclass from the
parsed flags and how the tests check every parser against the dataclasses. A group of flags
that several commands take (the engine's, the security settings) is one function, called by
each; `forward` turns a group's parsed values back into the flags that start a child process
with them (`afd serve`).

The groups every service shares live here; each service's own flags live beside it
(`services/*/flags.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, TypeVar

from afd.config import EXPERT_COMPUTE, ExpertConfig, ModelConfig
from afd.errors import ConfigError
from afd.security import Security
from afd.sidecar import SidePortConfig

T = TypeVar("T")

Group = argparse.ArgumentParser | argparse._ArgumentGroup


def field_default(cls: type, name: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise ConfigError(f"{cls.__name__} has no field {name!r}")
    f = fields[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ConfigError(f"{cls.__name__}.{name} has no default for a flag to take")


GIVEN = "_given_flags"  # the dests of the flags a command line gave (set on the namespace)


class _Store(argparse.Action):
    """argparse's "store", remembering that the flag was given: `forward` passes a value the
    user gave on even when it equals the default (a launcher may otherwise choose its own)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(values, list):  # nargs: a frozen config's field is a tuple
            values = tuple(values)
        setattr(namespace, self.dest, values)
        given = getattr(namespace, GIVEN, None) or set()
        setattr(namespace, GIVEN, given | {self.dest})


def option(group: Group, flag: str, cls: type, name: str, **kwargs: Any) -> argparse.Action:
    """Declare `flag` as the command-line form of `cls.name` (see the module docstring)."""
    default = field_default(cls, name)
    if isinstance(default, bool) and "action" not in kwargs:
        kwargs["action"] = "store_false" if default else "store_true"
    else:
        if default is not None and "type" not in kwargs and "action" not in kwargs:
            kwargs["type"] = type(default)
        kwargs.setdefault("action", _Store)
        kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        if default not in ("", None):
            kwargs["help"] = (kwargs.get("help", "") + " (default: %(default)s)").strip()
    action = group.add_argument(flag, dest=name, default=default, **kwargs)
    action.field = (cls, name)  # type: ignore[attr-defined]
    return action


def build(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """`cls` from the parsed flags that fill its fields, plus `given` (which wins); the
    dataclass validates itself. A flag's value lands under its field's name, so fields of one
    name in two configs (`threads`, `drain_timeout_s`) take one flag: keep their meaning one."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {n: getattr(args, n) for n in names if hasattr(args, n) and n not in given}
    return cls(**values, **given)


def forward(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The flags that give a child process the values parsed for `actions` (those neither given
    nor changed from their default are left out: the child has the same default)."""
    argv: list[str] = []
    given = getattr(args, GIVEN, None) or set()
    for a in actions:
        value = getattr(args, a.dest)
        if value == a.default and a.dest not in given:
            continue
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
            argv.append(a.option_strings[0])
        elif isinstance(value, tuple | dict):  # a JSON flag's value, in its JSON form
            argv += [
                a.option_strings[0],
                json.dumps(list(value) if isinstance(value, tuple) else value),
            ]
        else:
            argv += [a.option_strings[0], str(value)]
    return argv


# vLLM's --dtype values and what afd computes in for each (afd computes in bf16 or fp32)
DTYPES = {
    "auto": "bfloat16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "float": "float32",
}


def compute_dtype(text: str) -> str:
    """A --dtype value, vLLM's names included (`auto` is bfloat16)."""
    if text in ("float16", "half", "fp16"):
        raise argparse.ArgumentTypeError(
            f"{text}: afd computes in bfloat16 or float32 (auto is bfloat16)"
        )
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(DTYPES)}")
    return DTYPES[text]


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (vLLM's form: --default-chat-template-kwargs '{"a": 1}')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def json_strings(text: str) -> tuple[str, ...]:
    """A flag's JSON list of strings (vLLM's form: --allowed-origins '["https://a.example"]')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings")
    return tuple(value)


# ---- groups every service takes ----------------------------------------------------------


def add_model_flag(group: Group) -> None:
    group.add_argument(
        "--model",
        help="local Hugging Face checkpoint directory (default: the embedded demo model, whose "
        "text is meaningless)",
    )


def model_config(
    model: str | None, quantization: str | None = None, lm_head: bool = False
) -> ModelConfig:
    """The model a `--model` names; without one, the embedded demo model (built on first use);
    with its weights quantized as they load where `--quantization` (and `--quantize-lm-head`)
    asks."""
    if model:
        return ModelConfig.from_hf(model).with_quantization(quantization, lm_head)
    from afd.demo import demo_model_dir

    return ModelConfig.from_hf(demo_model_dir()).with_quantization(quantization, lm_head)


QUANTIZATION_FLAG = "--quantization"


def add_quantization_flag(group: Group) -> argparse.Action:
    """vLLM's `--quantization`, for a checkpoint whose matmul weights are 16 or 32 bits."""
    return group.add_argument(
        QUANTIZATION_FLAG,
        choices=["fp8"],
        default=None,
        help="quantize the checkpoint's matmul weights as they load: fp8 is block-FP8 (e4m3, a "
        "scale per 128x128 block; embeddings, LM head, norms and routers stay as they are), "
        "half the bytes of bf16; a block-FP8 checkpoint is taken as it is",
    )


LM_HEAD_FLAG = "--quantize-lm-head"


def add_lm_head_flag(group: Group) -> argparse.Action:
    """The LM head in block-FP8 as well (the attention side holds it)."""
    return group.add_argument(
        LM_HEAD_FLAG,
        action="store_true",
        help="quantize the LM head to block-FP8 too as it loads, with --quantization fp8 or "
        "a block-FP8 checkpoint (as llama.cpp's 8-bit files hold it; without this flag the "
        "head stays in 16 bits, as vLLM's fp8 keeps it)",
    )


def served_name(model: str | None) -> str:
    """The model's name in the API: its directory's name, or the demo model's."""
    from afd.demo import SERVED_NAME

    return Path(model).name if model else SERVED_NAME


def add_security_flags(p: argparse.ArgumentParser, curve: bool = True) -> None:
    """Keys and certificates of the data plane (the control plane's TLS for the gateway,
    which has no ZeroMQ side: curve=False)."""
    g = p.add_argument_group("authentication (flags fall back to AFD_* environment variables)")
    if curve:
        option(g, "--curve-dir", Security, "curve_dir", help="ZeroMQ CURVE key directory")
    option(g, "--tls-cert", Security, "tls_cert", help="TLS certificate chain (PEM)")
    option(g, "--tls-key", Security, "tls_key", help="TLS private key (PEM)")
    option(
        g,
        "--tls-ca",
        Security,
        "tls_ca",
        help="CA bundle that verifies the peer; on a server it demands client certs",
    )


EXPERT_FLAGS = ("--expert-compute", "--expert-workspace-mb")
# the engine flags that FFN servers take too (afd serve passes them on)
FFN_FLAGS = (*EXPERT_FLAGS, QUANTIZATION_FLAG)


def add_expert_flags(group: Group) -> list[argparse.Action]:
    """How FFN shards multiply MXFP4 experts (`afd ffn`, and in-process shards)."""
    x = ExpertConfig
    return [
        option(
            group,
            EXPERT_FLAGS[0],
            x,
            "compute",
            choices=EXPERT_COMPUTE,
            help="MXFP4 experts: direct (a kernel reads the 4-bit weights), workspace (converted "
            "on use into a shared pool, least recently used out), auto (this CPU's default)",
        ),
        option(
            group,
            EXPERT_FLAGS[1],
            x,
            "workspace_mb",
            help="MiB of the converted-expert workspace (--expert-compute workspace)",
        ),
    ]


def experts(args: argparse.Namespace) -> ExpertConfig:
    return build(ExpertConfig, args)


def add_side_port_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP side port")
    option(g, "--metrics-host", SidePortConfig, "metrics_host", help="its interface")
    option(
        g,
        "--metrics-port",
        SidePortConfig,
        "metrics_port",
        help="/metrics, /health, /ready (0: off)",
    )


def security(args: argparse.Namespace) -> Security:
    return build(Security, args).with_env()


def env_default(name: str, fallback: str = "") -> str:
    """A secret's default from the environment, which keeps it out of the process list."""
    return os.environ.get(name, fallback)
