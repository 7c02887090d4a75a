"""A decode step's layers as one native call (services/attention/stack.py) against the layer
loop it replaces: on each of afd's kernel paths this machine runs, the same tokens with the same
logprobs, the same routing counted, and every layer's timing kept. Qwen3-MoE's test checkpoint
has a dense layer between two MoE layers (its MLP in the stack too), Mixtral's is MoE
throughout; gpt-oss's (biases, sinks, sliding windows, its own router, experts
with biases and the clamped SwiGLU) once with BF16 experts and once with MXFP4 ones multiplied
as stored; DeepSeek-V3's (MLA, grouped sigmoid routing with a selection bias, a shared expert,
a dense first layer) and V3.2's (its indexer's selection in each layer's call); Step-3's
(MFA, a shared expert, dense layers: the demo model's shape). A
tie across a layer's top-k cut leaves that layer to torch and the stack goes on from the next;
a failing experts call fails the step with its cause."""

from __future__ import annotations

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd.kernels import gemm
from afd.kernels.decode_stack import ExpertsFailed, NativeDecodeStack
from afd_cli.local import local_engine

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 57)), [7, 7, 7], list(range(100, 119))]


def _config(path, stack: bool) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig.from_hf(path),
        dtype="bfloat16",
        a2f_dtype="bf16",
        micro_batches=1,
        decode_stack=stack,
        num_scheduler_steps=1,  # one step a call: bursts have their own tests (test_burst.py)
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),
    )


def _generate(path, stack: bool, prepare=None, logprobs: int | None = 1):
    """(tokens, logprobs, expert load, layers the stacks ran, inline timings) of greedy runs."""
    with local_engine(_config(path, stack), 1, progress=False) as eng:
        if prepare is not None:
            prepare(eng)
        inline = []
        step = eng.step

        def spy():
            result = step()
            inline.extend(stamps for _, stamps in eng.dispatcher.timing.inline)
            return result

        eng.step = spy
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=logprobs)
        reqs = eng.generate(PROMPTS, sp)
        eng.dispatcher.count_routed(flush=True)
        tokens = [r.output_token_ids for r in reqs]
        logprobs = [[lp.logprob for lp in r.output_logprobs] for r in reqs]
        ran = sum(len(s) for s in inline)
        return tokens, logprobs, eng.dispatcher.expert_load.clone(), ran, inline


@pytest.mark.parametrize(
    "ckpt",
    [
        "qwen3_dir", "mixtral_dir", "gpt_oss_dir", "gpt_oss_mxfp4_dir", "deepseek_dir", "dsa_dir",
        "step3_dir",
    ],
)  # fmt: skip
def test_the_stack_gives_the_layer_loops_tokens_and_logprobs(native_path, ckpt, request):
    path = request.getfixturevalue(ckpt)
    tokens, logprobs, load, ran, inline = _generate(path, stack=True)
    want_tokens, want_logprobs, want_load, ran_without, _ = _generate(path, stack=False)
    assert ran > 0 and ran_without == 0, "the stack did not run (or ran when off)"
    assert tokens == want_tokens
    assert logprobs == want_logprobs  # the same bits, not merely the same argmax
    assert torch.equal(load, want_load), "the stacked layers' routing was counted differently"
    stamps = torch.cat(inline)  # each layer: start <= attention end <= experts end
    assert bool((stamps[:, 1] >= stamps[:, 0]).all() and (stamps[:, 2] >= stamps[:, 1]).all())


@pytest.mark.parametrize("ckpt", ["mixtral_dir", "gpt_oss_mxfp4_dir"])
def test_the_last_stack_runs_the_lm_head(native_path, ckpt, request, monkeypatch):
    """The call that ends the model computes the decode steps' logits too (the final norm and
    the LM head's matmul in the call); the tokens and logprobs above are those logits'. Each
    decode step's head is the stack's, none falls back to model.logits."""
    from services.attention.model import AttentionModel
    from services.attention.stack import DecodeStack

    taken, per_op = [], []
    take, logits = DecodeStack.take_logits, AttentionModel.logits
    monkeypatch.setattr(
        DecodeStack, "take_logits", lambda self, h: taken.append(take(self, h)) or taken[-1]
    )
    monkeypatch.setattr(
        AttentionModel, "logits", lambda self, h: per_op.append(h.shape[0]) or logits(self, h)
    )
    _generate(request.getfixturevalue(ckpt), stack=True)
    fused = [t for t in taken if t is not None]
    assert fused and all(t.dtype == torch.float32 for t in fused)
    # model.logits ran for the prefill steps only: one per prompt's last chunk at most
    assert len(per_op) <= len(PROMPTS) and len(fused) + len(per_op) == len(taken)


@pytest.mark.parametrize("ckpt", ["qwen3_dir", "mixtral_dir"])
def test_the_stack_embeds_the_tokens_and_its_head_picks_greedy_ones(
    native_path, ckpt, request, monkeypatch
):
    """Greedy steps without logprobs: a stack that starts the model embeds the step's tokens in
    its call, and its head's argmax is the step's pick (the sampler reads no logits); the
    tokens are the layer loop's (Qwen3's dense layer inside the stack)."""
    from services.attention import sampler
    from services.attention.model import AttentionModel
    from services.attention.stack import DecodeStack

    path = request.getfixturevalue(ckpt)
    want = _generate(path, stack=False, logprobs=None)[0]
    picked, embedded, read = [], [], []
    argmax_of, embed, rows = DecodeStack.argmax_of, AttentionModel.embed, sampler.argmax_rows
    monkeypatch.setattr(
        DecodeStack, "argmax_of", lambda self, x: picked.append(argmax_of(self, x)) or picked[-1]
    )
    monkeypatch.setattr(
        AttentionModel, "embed", lambda self, t: embedded.append(t.shape[0]) or embed(self, t)
    )
    monkeypatch.setattr(sampler, "argmax_rows", lambda x: read.append(x.shape[0]) or rows(x))
    tokens = _generate(path, stack=True, logprobs=None)[0]
    assert tokens == want
    hinted = [p for p in picked if p is not None]
    assert len(hinted) >= 11, "the decode steps' picks were not the head's"
    # torch embedded and the sampler read logits for the prefill steps only
    steps = len(picked)
    assert len(embedded) == len(read) == steps - len(hinted)


def test_a_token_outside_the_embedding_fails_the_call_before_it_runs(native_path, mixtral_dir):
    with local_engine(_config(mixtral_dir, True), 1, progress=False) as eng:
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        stack, table = eng.runner.stack._stacks[0], eng.model.embed_w
        k = stack.parts[0].k_cache.clone()
        one = torch.zeros(1, dtype=torch.long)
        meta = (one, one, one.view(1, 1), one + 1)
        for bad in (table.shape[0], -1):
            with pytest.raises(IndexError, match=f"token id {bad} is not in the embedding"):
                stack(None, *meta, embed=(torch.tensor([bad]), table))
        assert torch.equal(stack.parts[0].k_cache, k), "a layer ran"


def test_a_dense_layer_joins_the_stack_where_its_mlp_is_one_native_call(
    native_path, qwen3_dir, monkeypatch
):
    """Qwen3's test checkpoint has a dense layer between MoE layers: its MLP runs in the stack
    (mlp.c), so one stack runs every layer (and can run bursts); where that MLP is not one
    native call, the dense layer splits the stack and runs in the loop."""
    from afd.kernels.mlp import NativeMLP

    cfg = ModelConfig.from_hf(qwen3_dir)
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe(i)]
    assert dense, "the test checkpoint lost its dense layer"
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with local_engine(_config(qwen3_dir, True), 1, progress=False) as eng:
        eng.generate([[1, 2, 3]], sp)
        stacks = eng.runner.stack._stacks
        assert sorted(stacks) == [0]
        assert stacks[0].dense == [i in dense for i in range(cfg.num_layers)]
    monkeypatch.setattr(NativeMLP, "usable", staticmethod(lambda w13, w2: False))
    with local_engine(_config(qwen3_dir, True), 1, progress=False) as eng:
        eng.generate([[1, 2, 3]], sp)
        assert sorted(eng.runner.stack._stacks) == [0, dense[0] + 1]


def _tie(layer: int):
    """Make every router logit of `layer` tie: its router rows all the same."""

    def prepare(eng):
        r = eng.model.layers[layer].router
        same = torch.randn(1, r.w.shape[1]).to(torch.bfloat16).expand(r.w.shape[0], -1)
        r.w.copy_(gemm.lay_out(same, r.isa))

    return prepare


@pytest.mark.parametrize("tied", [0, 1])
def test_a_tied_layer_routes_as_torch_in_the_stack_or_in_torch(
    native_path, tie_routing, mixtral_dir, tied, monkeypatch
):
    """A layer whose logits all tie: with topk.c's replay of torch.topk the stack routes it
    itself and runs every layer; without, the stack stops there, torch routes it and sends its
    experts, and the stack goes on from the next layer (Mixtral's test model has two). The
    same tokens and logprobs as the layer loop either way."""
    from services.attention.dispatch import FFNDispatcher

    firsts: list[int] = []
    ran_inline = FFNDispatcher.ran_inline

    def spy(self, first, ids, stamps, **kw):
        if len(ids):
            firsts.append(first)
        return ran_inline(self, first, ids, stamps, **kw)

    monkeypatch.setattr(FFNDispatcher, "ran_inline", spy)
    tokens, logprobs, load, ran, inline = _generate(mixtral_dir, True, _tie(tied))
    want = _generate(mixtral_dir, False, _tie(tied))
    assert ran > 0 and tokens == want[0] and logprobs == want[1]
    assert torch.equal(load, want[2])
    if tie_routing:
        assert {len(s) for s in inline} == {2}, "each step: both layers in the stack"
        assert set(firsts) == {0}
        return
    assert {len(s) for s in inline} == {1}, "each step: one layer in the stack, one in torch"
    assert set(firsts) == {1 - tied}, "the stack did not run the layer that did not tie"


def test_a_failing_experts_call_fails_the_step_with_its_cause(
    native_path, mixtral_dir, monkeypatch
):
    def fail(self, *args, **kwargs):
        raise ExpertsFailed(0)

    monkeypatch.setattr(NativeDecodeStack, "__call__", fail)
    with local_engine(_config(mixtral_dir, True), 1, progress=False) as eng:
        (req,) = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
        assert "failed layer 0: internal: the fused experts of layer 0 failed" in req.error
        # the engine keeps serving: with the stack off the same request completes
        eng.runner.stack = None
        (again,) = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
        assert not again.error and len(again.output_token_ids) == 4
