"""Every flag of every serving command is declared against the config field it fills, and its
default is that field's default: the parsers are walked here, against the dataclasses."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from afd.config import CacheConfig, EngineConfig, SchedulerConfig
from afd.errors import ConfigError
from afd.flags import field_default, forward
from afd_cli.main import build_parser

SERVING = ("serve", "attention", "ffn", "gateway", "generate")
# Flags that fill no field verbatim: a path or list parsed into one, or the job's input.
NOT_A_FIELD = {
    "--model",  # a directory: ModelConfig.from_hf reads it (or the demo model)
    "--ffn",  # "a|b,c": EngineConfig.ffn_addresses
    "--shard",  # "i/N": FFNServerConfig.shard, given the model's expert count
    "--attention",  # gateway: "host:port,...": GatewayConfig.attention
    "--served-model-name",  # GatewayConfig.model_name, which defaults to the directory's name
    "--prompt",  # generate's prompts
    "--prompts-file",
    "--api-key-file",  # read into GatewayConfig.api_key
    "--quantization",  # applied to the model --model names: ModelConfig.with_quantization
    "--quantize-lm-head",  # the same call's lm_head
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("command", SERVING)
def test_every_flag_default_is_its_config_default(command):
    parser = _subparsers(build_parser())[command]
    checked = 0
    for action in _flags(parser):
        name = action.option_strings[0]
        if getattr(action, "vllm", False):  # vLLM's names, translated (afd_cli/vllm_flags.py)
            assert command == "serve"
            continue
        if not hasattr(action, "field"):
            assert name in NOT_A_FIELD, f"afd {command} {name} is not declared against a field"
            continue
        cls, field = action.field
        assert action.default == field_default(cls, field), f"afd {command} {name}"
        assert action.dest == field
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("command", SERVING)
def test_no_two_flags_fill_one_field(command):
    """`afd serve` takes every group's flags: two fields of one name (a scheduling policy and
    a routing policy, say) would have one flag silently fill both."""
    dests = [a.dest for a in _flags(_subparsers(build_parser())[command])]
    assert sorted({d for d in dests if dests.count(d) > 1}) == []


def test_the_walk_can_fail():
    p = argparse.ArgumentParser()
    p.add_argument("--micro-batches", type=int, default=2)  # the drift this rules out
    (action,) = _flags(p)
    assert not hasattr(action, "field")
    assert action.default != field_default(EngineConfig, "micro_batches")


def test_serve_passes_on_what_it_was_given():
    parser = build_parser()
    args = parser.parse_args(["serve", "--micro-batches", "2", "--sla-tpot", "0.1"])
    assert forward(args, args.engine_actions) == ["--micro-batches", "2"]
    assert forward(args, args.api_actions) == ["--sla-tpot", "0.1"]
    args = parser.parse_args(["serve", "--private-metrics"])
    assert forward(args, args.api_actions) == ["--private-metrics"]
    # and what it passes on parses back to the same values in the child's parser
    child = parser.parse_args(["attention", "--ffn", "tcp://x:1", "--micro-batches", "2"])
    assert child.micro_batches == 2


@pytest.mark.parametrize(
    ("cls", "bad"),
    [
        (EngineConfig, {"micro_batches": 0}),
        (EngineConfig, {"a2f_dtype": "fp16"}),
        (EngineConfig, {"ffn_addresses": ("tcp://a:1|",)}),
        (EngineConfig, {"ffn_timeout_s": 0.0}),
        (CacheConfig, {"block_size": 0}),
        (SchedulerConfig, {"max_num_seqs": 0}),
    ],
)
def test_configs_validate_themselves(cls, bad, tiny_model_config):
    base = {"model": tiny_model_config} if cls is EngineConfig else {}
    with pytest.raises(ConfigError):
        cls(**base, **bad)
    assert dataclasses.is_dataclass(cls(**base))


@pytest.fixture
def tiny_model_config():
    from afd.config import ModelConfig
    from afd.demo import TINY_CONFIG

    return ModelConfig.from_dict(TINY_CONFIG)


def test_serve_refuses_what_its_children_would_before_starting_them():
    from afd_cli.serve import config

    parser = build_parser()
    for argv, problem in (
        (["--micro-batches", "0"], "micro-batches"),
        (["--num-scheduler-steps", "0"], "scheduler steps"),
        (["--sla-tpot", "-1"], "SLA"),
        (["--transport", "inproc", "--kv-cache-gb", "0"], "KV cache"),
    ):
        with pytest.raises(ConfigError, match=problem):
            config(parser.parse_args(["serve", *argv]))


def test_serve_takes_the_model_first_as_vllm_serve_does(tmp_path):
    from afd.demo import TINY_CONFIG, write_step3_checkpoint
    from afd_cli.serve import config

    model = write_step3_checkpoint(tmp_path / "m", TINY_CONFIG, seed=0, init_std=0.2)
    parser = build_parser()
    cfg = config(parser.parse_args(["serve", str(model), "--attention", "2"]))
    assert cfg.model == str(model) and cfg.attention == 2
    assert config(parser.parse_args(["serve", "--model", str(model)])).model == str(model)
    with pytest.raises(ConfigError, match="two models"):
        config(parser.parse_args(["serve", str(model), "--model", str(tmp_path)]))


def test_serve_takes_a_vllm_serve_command_line(tmp_path):
    """The flags of a typical `vllm serve` command line: each becomes afd's setting of the same
    meaning or is accepted where afd behaves so already; what afd cannot do is an error."""
    from afd.demo import TINY_CONFIG, write_step3_checkpoint
    from afd_cli.serve import config

    model = str(write_step3_checkpoint(tmp_path / "m", TINY_CONFIG, seed=0, init_std=0.2))
    parser = build_parser()
    vllm = [
        "serve", model, "--trust-remote-code", "--dtype", "auto", "--tensor-parallel-size",
        "1", "-dp", "2", "--max-model-len", "512", "--gpu-memory-utilization", "0.9",
        "--seed", "7", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", "4096", "--enforce-eager", "--swap-space", "4",
        "--disable-log-requests", "--disable-log-stats", "--enable-expert-parallel",
        "--load-format", "safetensors", "--served-model-name", "m",
    ]  # fmt: skip
    cfg = config(parser.parse_args(vllm))
    assert cfg.attention == 2 and cfg.dtype == "bfloat16"
    args = cfg.engine_args
    for flag in ("--no-prefix-caching", "--no-chunked-prefill"):
        assert flag in args
    assert args[args.index("--sampling-seed") + 1] == "7"
    assert args[args.index("--max-model-len") + 1] == "512"
    # what afd does by default is not passed on
    on = config(parser.parse_args(["serve", model, "--enable-prefix-caching"])).engine_args
    assert "--no-prefix-caching" not in on
    for argv, problem in (
        (["--tensor-parallel-size", "2"], "does not split a model's tensors"),
        (["-pp", "2"], "does not split"),
        (["-dp", "2", "--attention", "3"], "differ"),
    ):
        with pytest.raises(ConfigError, match=problem):
            config(parser.parse_args(["serve", model, *argv]))
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", model, "--dtype", "half"])


def test_a_seeded_engine_draws_unseeded_requests_alike(tmp_path):
    """--sampling-seed (vLLM's --seed): two engines with it give an unseeded sampling request
    the same tokens."""
    from dataclasses import replace

    from afd.config import ModelConfig
    from afd.control import SamplingParams
    from afd.demo import TINY_CONFIG, write_step3_checkpoint
    from afd_cli.local import local_engine

    model = write_step3_checkpoint(tmp_path / "m", TINY_CONFIG, seed=0, init_std=0.2)
    cfg = EngineConfig(model=ModelConfig.from_hf(model), sampling_seed=3)
    sp = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    runs = []
    for c in (cfg, cfg, replace(cfg, sampling_seed=4)):
        with local_engine(c, 1, progress=False) as eng:
            runs.append(eng.generate([[5, 6, 7]], sp)[0].output_token_ids)
    assert runs[0] == runs[1] != runs[2]


def _gateway_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["gateway", "--attention", "a:1", *argv])


def test_api_key_from_flag_file_or_environment(tmp_path, monkeypatch):
    from services.gateway.flags import api_key

    f = tmp_path / "key"
    f.write_text("sk-file\n")  # as `kubectl create secret --from-file` keeps a newline
    monkeypatch.delenv("AFD_API_KEY", raising=False)
    monkeypatch.delenv("AFD_API_KEY_FILE", raising=False)
    assert api_key(_gateway_args()) == ""
    assert api_key(_gateway_args("--api-key-file", str(f))) == "sk-file"
    assert api_key(_gateway_args("--api-key", "sk-flag", "--api-key-file", str(f))) == "sk-flag"
    monkeypatch.setenv("AFD_API_KEY_FILE", str(f))
    assert api_key(_gateway_args()) == "sk-file"
    monkeypatch.setenv("AFD_API_KEY", "sk-env")
    assert api_key(_gateway_args()) == "sk-env"
    # a key file that cannot be used is an error, never authentication turned off
    for bad, why in ((tmp_path / "missing", "cannot read"), (tmp_path / "empty", "is empty")):
        if why == "is empty":
            bad.write_text("\n")
        with pytest.raises(ConfigError, match=why):
            api_key(_gateway_args("--api-key-file", str(bad)))


def test_json_flags_pass_on_in_their_json_form():
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}']
    )
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    passed = forward(args, args.api_actions)
    child = parser.parse_args(["gateway", "--attention", "x:1", *passed])
    assert child.default_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--default-chat-template-kwargs", "[1]"])
