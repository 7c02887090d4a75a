"""The demo checkpoint, its tokenizer and the independent step3_text reference forward."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

# the repo root, so `tests.reference` imports however pytest was started
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from afd import demo  # noqa: E402
from afd.config import ModelConfig  # noqa: E402
from tests.reference import step3_dense as ref  # noqa: E402

TINY = demo.TINY_CONFIG


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return demo.write_step3_checkpoint(out, TINY, seed=7, init_std=0.08)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, tiny_dir: Path) -> None:
    again = demo.write_step3_checkpoint(tmp_path / "again", TINY, seed=7, init_std=0.08)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = demo.write_step3_checkpoint(tmp_path / "other", TINY, seed=8, init_std=0.08)
    a = load_file(str(tiny_dir / "model.safetensors"))
    b = load_file(str(other / "model.safetensors"))
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.layers.1.moe.gate.weight"], b["model.layers.1.moe.gate.weight"])


def test_checkpoint_holds_every_step3_tensor_with_its_shape(tiny_dir: Path) -> None:
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    shapes = demo.step3_tensor_shapes(json.loads((tiny_dir / "config.json").read_text()))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == shapes
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    h, e, i = TINY["hidden_size"], TINY["moe_num_experts"], TINY["moe_intermediate_size"]
    assert shapes["model.layers.1.moe.gate_proj.weight"] == (e, i, h)
    assert shapes["model.layers.1.moe.down_proj.weight"] == (e, h, i)
    assert (
        "model.layers.0.mlp.up_proj.weight" in shapes
        and "model.layers.0.moe.gate.weight" not in shapes
    )
    assert "model.layers.2.mlp.down_proj.weight" in shapes  # last layer dense
    norm = tensors["model.layers.0.input_layernorm.weight"].float()
    assert (norm - 1).abs().max() < 0.2 and not torch.all(norm == 1)
    assert tensors["lm_head.weight"][demo.TOKENIZER_SIZE :].abs().sum() == 0  # padding rows


def test_model_config_parses_the_demo_layout(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_hf(tiny_dir)
    assert cfg.model_type == "step3_text" and cfg.attention == "mfa"
    assert cfg.moe_layers == (False, True, False)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 16)
    assert cfg.q_lora_dim == TINY["share_q_dim"]
    assert cfg.shared_expert_intermediate_size == TINY["share_expert_dim"]
    assert (cfg.num_experts, cfg.top_k, cfg.norm_topk_prob) == (8, 2, True)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= demo.TOKENIZER_SIZE
    assert cfg.eos_token_ids == (demo.EOS_TOKEN_ID,) and cfg.bos_token_id == demo.BOS_TOKEN_ID


def test_sharded_write_has_an_index_covering_every_tensor(tmp_path: Path, tiny_dir: Path) -> None:
    out = demo.write_step3_checkpoint(tmp_path / "sharded", TINY, seed=7, init_std=0.08, shards=3)
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    stored: dict[str, str] = {}
    total = 0
    for f in files:
        with safe_open(str(out / f), framework="pt") as fh:
            for name in fh.keys():
                assert name not in stored, f"{name} stored twice"
                stored[name] = f
                t = fh.get_tensor(name)
                total += t.numel() * t.element_size()
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    # sharding changes the files, never the tensors
    whole = load_file(str(tiny_dir / "model.safetensors"))
    sharded = ref.load_state(out)
    assert whole.keys() == sharded.keys()
    assert all(torch.equal(whole[n], sharded[n]) for n in whole)


def test_write_refuses_to_overwrite(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(FileExistsError):
        demo.write_step3_checkpoint(tmp_path / "taken", TINY, seed=0, init_std=0.05)
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no temp dir left behind


TEXTS = [
    "plain ascii, with  double spaces\tand\ttabs\n\nand newlines ",
    "héllo wörld — ünïcödé ñ",
    "中文测试，日本語のテキスト、한국어",
    "emoji 🎉👨‍👩‍👧‍👦🏳️‍🌈 and a lone combining mark e\u0301",
    "\x00\x01 control \x7f bytes \u2028 and \U0010ffff",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_utf8_exactly(tiny_dir: Path, text: str) -> None:
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
    assert tok.decode(ids) == text


def test_tokenizer_special_tokens(tiny_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == demo.TOKENIZER_SIZE
    for k, t in enumerate(demo.SPECIAL_TOKENS):
        assert tok.token_to_id(t) == demo.NUM_BYTE_TOKENS + k
    assert tok.encode("<|user|>hi<|end|>").ids == [258, 104, 105, demo.EOS_TOKEN_ID]


def test_auto_tokenizer_renders_the_chat_template(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    assert tok.eos_token == demo.EOS_TOKEN and tok.eos_token_id == demo.EOS_TOKEN_ID
    assert tok.bos_token_id == demo.BOS_TOKEN_ID
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi 👋"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|begin|><|system|>be brief<|end|><|user|>hi 👋<|end|><|assistant|>"
    plain = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert plain == text.removesuffix("<|assistant|>")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # v5 returns a BatchEncoding
    assert ids[0] == demo.BOS_TOKEN_ID and ids[-1] == 259  # <|assistant|>
    assert tok.decode(tok.encode("日本 🎉", add_special_tokens=False)) == "日本 🎉"
    assert (tiny_dir / "chat_template.jinja").read_text() == demo.CHAT_TEMPLATE


def test_demo_model_dir_builds_once_and_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # build the tiny shape instead of the real one: this test is about caching
    monkeypatch.setattr(demo, "DEMO_CONFIG", TINY)
    with caplog.at_level(logging.WARNING, logger="afd.demo"):
        first = demo.demo_model_dir(str(tmp_path))
    assert first == tmp_path / demo.DEMO_NAME
    assert "meaningless" in caplog.text and "--model" in caplog.text
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    time.sleep(0.01)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="afd.demo"):
        second = demo.demo_model_dir(str(tmp_path))
    assert second == first and (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert demo.DEMO_NOTICE in caplog.text  # every use says so, not just the first
    assert [p.name for p in tmp_path.iterdir()] == [demo.DEMO_NAME]
    assert "meaningless" in (first / "README.md").read_text()


def test_demo_model_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "DEMO_CONFIG", TINY)
    monkeypatch.setenv("AFD_CACHE_DIR", str(tmp_path / "env"))
    assert demo.demo_model_dir() == tmp_path / "env" / demo.DEMO_NAME


def test_demo_model_dir_tolerates_losing_a_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "DEMO_CONFIG", TINY)
    winner = demo.write_step3_checkpoint(tmp_path / demo.DEMO_NAME, TINY, seed=0, init_std=0.05)
    stamp = (winner / "model.safetensors").stat().st_mtime_ns
    # the first check ran before the winner's rename landed: we build too, and our rename loses
    calls = iter([False, True])
    monkeypatch.setattr(demo, "_is_complete", lambda p: next(calls))
    assert demo.demo_model_dir(str(tmp_path)) == winner
    assert (winner / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [demo.DEMO_NAME]


def test_the_real_demo_model_builds_quickly_and_parses(tmp_path: Path) -> None:
    start = time.monotonic()
    path = demo.demo_model_dir(str(tmp_path))
    assert time.monotonic() - start < 30
    cfg = ModelConfig.from_hf(path)
    assert cfg.moe_layers == (False, True, True, True, True, False)
    assert (cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.q_lora_dim) == (512, 32, 3, 256)
    assert cfg.vocab_size == 320 and cfg.torch_dtype == "bfloat16"


def test_reference_forward_is_causal_and_deterministic(tiny_dir: Path) -> None:
    state, cfg = ref.load_state(tiny_dir), ref.load_config(tiny_dir)
    ids = list(b"causal check")
    logits = ref.forward(state, cfg, ids)
    assert logits.shape == (len(ids), cfg["vocab_size"]) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, ref.forward(state, cfg, ids))
    changed = ids[:5] + [(t + 1) % 256 for t in ids[5:]]
    other = ref.forward(state, cfg, changed)
    torch.testing.assert_close(other[:5], logits[:5], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(other[5:], logits[5:])
    # a prefix sees exactly what the full sequence saw at those positions
    torch.testing.assert_close(ref.forward(state, cfg, ids[:3]), logits[:3], rtol=1e-5, atol=1e-5)


def test_reference_greedy_generate(tiny_dir: Path) -> None:
    state, cfg = ref.load_state(tiny_dir), ref.load_config(tiny_dir)
    prompt = [demo.BOS_TOKEN_ID, *b"hello"]
    out = ref.greedy_generate(state, cfg, prompt, 6, ignore_eos=True)
    assert len(out) == 6 and out == ref.greedy_generate(state, cfg, prompt, 6, ignore_eos=True)
    # each greedy step is the argmax of a full forward over what came before
    full = ref.forward(state, cfg, prompt + out[:-1])
    assert full[len(prompt) - 1 :].argmax(-1).tolist() == out
    stop_cfg = {**cfg, "eos_token_id": out[1]}
    assert ref.greedy_generate(state, stop_cfg, prompt, 6) == out[: out.index(out[1]) + 1]


@pytest.mark.parametrize("env,shown", [("1", False), ("", True), ("0", True)])
def test_tqdm_disable_turns_the_loading_bar_off(tiny_dir, monkeypatch, capsys, env, shown):
    """Containers set TQDM_DISABLE=1 to keep bars out of their logs; tqdm reads it only when
    its caller does not pass `disable`, which the loader always does."""
    from afd.checkpoint import load_weights

    monkeypatch.setenv("TQDM_DISABLE", env)
    cfg = ModelConfig.from_hf(tiny_dir)
    load_weights(cfg, "attention", torch.float32, progress=True)
    assert ("loading attention weights" in capsys.readouterr().err) == shown
