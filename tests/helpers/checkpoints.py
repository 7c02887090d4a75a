"""Tiny random Hugging Face checkpoints written with `transformers` itself (fixed seeds)."""

from __future__ import annotations

from pathlib import Path

import torch

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


def hf_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


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
