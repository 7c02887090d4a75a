"""Tiny random Hugging Face checkpoints (fixed seeds), and the references that check afd on them.

Written with `transformers` itself where it implements the family, with afd's demo writer for
Step-3 (which transformers cannot run). `REFERENCE_CHECKPOINTS` names one per family afd serves;
tests/unit/test_families.py holds it equal to afd's family registry, so a family cannot be
added without a greedy-vs-reference test.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tests.reference import step3_dense

# A large init makes every layer move the logits, so a wrong layer cannot hide.
INIT = 0.2


def qwen3_moe(out: Path, seed: int = 0, **over) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
        initializer_range=INIT,
        rope_theta=10000.0,
        mlp_only_layers=[1],
        eos_token_id=None,
    )
    kw.update(over)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)).eval()
    model.save_pretrained(out)
    return out


def mixtral(out: Path, seed: int = 1, **over) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        initializer_range=INIT,
        eos_token_id=None,
        bos_token_id=None,
    )
    kw.update(over)
    model = MixtralForCausalLM(MixtralConfig(**kw)).eval()
    model.save_pretrained(out)
    return out


# The tiny DeepSeek shape both DeepSeek writers share: MLA with a low-rank query, 8 experts in 4
# groups of which 2 compete (top-3), a shared expert, one dense layer.
_DEEPSEEK = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=24,
    max_position_embeddings=128,
    initializer_range=INIT,
    eos_token_id=None,
    bos_token_id=None,
)


def _deepseek(config_cls, model_cls, out: Path, seed: int, kw: dict) -> Path:
    """Write a DeepSeek checkpoint with a random selection bias (transformers initialises it to
    zeros, which would hide a bias applied to the weights)."""
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn(kw["n_routed_experts"]) * 0.3)
    model.save_pretrained(out)
    return out


# MLA dims the fused decode layer takes (afd/kernels/heads.py: whole AMX tiles a head for W_UK
# and W_UV; a rotary width of 16): the shared shape's are smaller
MLA_FUSED_DIMS = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)


def deepseek_v3(out: Path, seed: int = 4, **over) -> Path:
    """The shared DeepSeek shape (q_lora_rank=None for a full q_proj) with YaRN RoPE and both
    mscales."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.8,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    extra = dict(num_key_value_heads=4, routed_scaling_factor=2.5, rope_parameters=yarn)
    kw = {**_DEEPSEEK, **extra, **over}
    return _deepseek(DeepseekV3Config, DeepseekV3ForCausalLM, out, seed, kw)


def deepseek_v32(out: Path, seed: int = 5, **over) -> Path:
    """The shared DeepSeek shape plus the sparse-attention indexer, keeping 8 tokens per query,
    so that the test prompts (up to 53 tokens) drop most of their context."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    kw = {**_DEEPSEEK, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8, **over}
    return _deepseek(DeepseekV32Config, DeepseekV32ForCausalLM, out, seed, kw)


def gpt_oss(out: Path, seed: int = 6, **over) -> Path:
    """gpt-oss with a sliding window (8 keys) much shorter than the test contexts, sliding and
    full layers alternating, YaRN, and random sinks and biases (transformers initialises the
    biases to zeros, which would hide a bias dropped)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    }
    kw = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=128,
        initializer_range=INIT,
        rope_parameters=yarn,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    kw.update(over)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn_like(p) * INIT)
    model.save_pretrained(out)
    return out


def step3_text(out: Path, seed: int = 3, **over) -> Path:
    """Step-3 as afd's demo model writes it: MFA, a shared expert, dense layers 0 and 3, two
    safetensors shards."""
    from afd.demo import TINY_CONFIG, write_step3_checkpoint

    cfg = {**TINY_CONFIG, "num_hidden_layers": 4, "moe_layers_enum": "1,2", **over}
    return write_step3_checkpoint(out, cfg, seed=seed, init_std=INIT, shards=2)


def step3_dense_greedy(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy tokens of the independent dense Step-3 forward (tests/reference/step3_dense.py)."""
    state, cfg = step3_dense.load_state(path), step3_dense.load_config(path)
    return [step3_dense.greedy_generate(state, cfg, p, max_new, ignore_eos=True) for p in prompts]


Writer = Callable[[Path], Path]  # writes a tiny random checkpoint into a directory, returns it
Greedy = Callable[[Path, list[list[int]], int], list[list[int]]]  # (path, prompts, n) -> tokens

# model_type -> the tiny checkpoint afd's greedy tokens are checked on, for every family afd
# serves. Against transformers' own forward (tests/integration/test_engine_reference.py), unless
# the family is in DENSE_REFERENCES (tests/integration/test_step3_reference.py).
REFERENCE_CHECKPOINTS: dict[str, Writer] = {
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
    "step3_text": step3_text,
    "deepseek_v3": deepseek_v3,
    "deepseek_v32": deepseek_v32,
    "gpt_oss": gpt_oss,
}
# model_type -> an independent dense forward of our own, for families transformers cannot run.
DENSE_REFERENCES: dict[str, Greedy] = {"step3_text": step3_dense_greedy}
TRANSFORMERS_REFERENCED = tuple(m for m in REFERENCE_CHECKPOINTS if m not in DENSE_REFERENCES)


def hf_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {}
    quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if quant.get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        # transformers' own dequantizer expands the MXFP4 experts to `dtype` on load. Without
        # this, a transformers that has `kernels` and triton installed fetches its MXFP4 matmul
        # kernels from the Hugging Face Hub, which a box without network access cannot reach.
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        o = model.generate(
            torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
        )
        outs.append(o[0, len(p) :].tolist())
    return outs


@torch.inference_mode()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(tokens), V] (float32)."""
    return model(torch.tensor([tokens])).logits[0].float()


def greedy_gaps(model, prompt: list[int], generated: list[int]) -> list[float]:
    """For each generated token: how far below the reference's best logit it is (0 = argmax),
    with the reference teacher-forced on the generated tokens."""
    logits = hf_logits(model, prompt + generated)[len(prompt) - 1 : -1]  # [n, V]
    chosen = logits.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1)
    return (logits.max(dim=1).values - chosen).tolist()


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] -> (blocks [..., N, K/32, 16], scales [..., N, K/32]) uint8, quantized here
    independently of afd's writer: per 32 values the power of two 2^ceil(log2(amax / 6)), each
    value to the nearest e2m1 magnitude (random data has no ties), the even element in the low
    nibble; scales as biased exponents."""
    *lead, N, K = w.shape
    b = w.float().reshape(*lead, N, K // 32, 32)
    amax = b.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    v = b / torch.exp2(e).unsqueeze(-1)
    idx = (v.abs().unsqueeze(-1) - _FP4).abs().argmin(-1)
    code = idx + 8 * ((v < 0) & (idx > 0)).long()
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse, [..., N, K/32, 16] and [..., N, K/32] -> [..., N, K] float32."""
    signed = torch.cat([_FP4, -_FP4])
    lo, hi = signed[(blocks & 15).long()], signed[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., N, G, 32]
    w = vals * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return w.flatten(-2)


def gpt_oss_mxfp4(src: Path, out: Path) -> tuple[Path, Path]:
    """From a gpt-oss checkpoint: (its experts as MXFP4 in the released layout, `*_blocks`
    [E, out, in/32, 16] and `*_scales` with `quant_method: mxfp4`, which transformers
    dequantizes on load; the same numbers as a dense float32 checkpoint)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    mx_dir, dense_dir = out / "mxfp4", out / "dense"
    tensors = load_file(str(src / "model.safetensors"))
    mx, dense = {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mx[name] = dense[name] = t
            continue
        blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # stored [E, in, out]
        mx[name + "_blocks"], mx[name + "_scales"] = blocks, scales
        dense[name] = mxfp4_dequantize(blocks, scales).transpose(1, 2).contiguous()
    for d, ts in ((mx_dir, mx), (dense_dir, dense)):
        d.mkdir(parents=True)
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(src / "config.json", d / "config.json")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (mx_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return mx_dir, dense_dir


# Tensors a block-FP8 checkpoint keeps in high precision (as DeepSeek's do): embeddings, the LM
# head, norms, routers and their biases.
# kept as they are, as DeepSeek's checkpoints keep them (routers included: Mixtral's and
# gpt-oss's too; and V3.2's indexer head weights, a bf16 Linear beside its FP8 wq_b and wk)
_NOT_FP8 = (
    "embed_tokens", "lm_head", "norm", "layernorm", "mlp.gate.", "block_sparse_moe.gate.", "bias",
    "indexer.weights_proj", "mlp.router.",
)  # fmt: skip


def block_fp8_pair(
    src: Path, out: Path, block=(128, 128), e8m0=False, keep: tuple[str, ...] = _NOT_FP8
) -> tuple[Path, Path]:
    """From a checkpoint, (a block-FP8 copy as DeepSeek ships them: e4m3 weights, a
    `weight_scale_inv` per block, `quantization_config` in config.json; the same numbers
    dequantized, as a float32 checkpoint). Quantized here, independently of afd's own writer:
    each block's scale maps its largest magnitude to 448 (rounded up to a power of two with
    `e8m0`, stored as biased exponent bytes). 2-D tensors whose names hold one of `keep` stay
    as they are."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    fp8_dir, dense_dir = out / "fp8", out / "dense"
    tensors = load_file(str(src / "model.safetensors"))
    fp8, dense = {}, {}
    bn, bk = block
    for name, t in tensors.items():
        if t.dim() != 2 or any(s in name for s in keep):
            fp8[name] = dense[name] = t
            continue
        N, K = t.shape
        nN, nK = -(-N // bn), -(-K // bk)
        scale = torch.empty(nN, nK)
        q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
        deq = torch.empty(N, K)
        for i in range(nN):
            for j in range(nK):
                blk = t[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
                s = max(float(blk.abs().max()) / 448.0, 2.0**-126)
                if e8m0:
                    s = 2.0 ** torch.ceil(torch.log2(torch.tensor(s))).item()
                scale[i, j] = s
                qb = (blk / s).to(torch.float8_e4m3fn)
                q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = qb
                deq[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = qb.float() * s
        fp8[name] = q
        sname = name + "_scale_inv"
        fp8[sname] = (torch.log2(scale) + 127).to(torch.uint8) if e8m0 else scale
        dense[name] = deq
    for d, ts in ((fp8_dir, fp8), (dense_dir, dense)):
        d.mkdir(parents=True)
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(src / "config.json", d / "config.json")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"scale_fmt": "ue8m0"} if e8m0 else {}),
    }
    (fp8_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return fp8_dir, dense_dir
