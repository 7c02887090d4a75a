"""The decode step's layers in one native call, where attention and the experts share a process.

`afd serve` on a small host (and `afd generate`) runs the expert shard inside the attention
process, computing on the engine's thread (dispatch.py: serve_local). There a decode-only
micro-batch's layers are one native call (afd/kernels/decode_stack.py): per layer the fused
attention layer, the shard's fused experts and the residual add, the same kernels with the same
roundings as the layer loop of pipeline.py. The FFN side offers its experts for this
(FFNServing.inline_experts) and the dispatcher counts the routing and keeps the timing as if
each layer had been a message (FFNDispatcher.ran_inline), so the metrics read the same.

It applies where every layer has the fused attention layer with its router's top-k in the call,
the one shard computes each layer with its fused experts alone, the wire is bf16 and the batch
is below oneDNN's crossover on both sides. A layer whose routing the call leaves to torch (a tie
across the top-k cut where afd/kernels/topk.py's check did not pass) is routed and sent as
usual, and the stack goes on from the next layer.

Where a call ends at the model's last layer and the step samples every row, the call also runs
the LM head (the final norm and the head's matmul, the same kernels as model.logits on the
same weight): the runner takes those logits for the hidden they belong to (take_logits).
"""

from __future__ import annotations

import torch

from afd.errors import TransportError
from afd.kernels import gemm
from afd.kernels.decode_stack import ExpertsFailed, LayerParts, NativeDecodeStack, StackHead
from afd.kernels.fp8_gemm import fp8_block
from afd.kernels.sample import Draws
from services.attention.batch import MicroBatch
from services.attention.dispatch import FFNDispatcher, Pending
from services.attention.kv_cache import KVCache
from services.attention.model import AttentionModel


class DecodeStack:
    """The runner's view of the native stacks: one per run of consecutive layers that can be one
    call (a dense layer between MoE layers, DeepSeek's first dense layers, stay in the loop),
    built on first use for the shard in place then, rebuilt if that shard changes."""

    def __init__(self, model: AttentionModel, cache: KVCache, ffn: FFNDispatcher):
        self.model, self.cache, self.ffn = model, cache, ffn
        self._built_for: object = None  # the serving the stacks were built with
        self._stacks: dict[int, NativeDecodeStack] = {}  # by first layer
        self._within: dict[int, tuple[NativeDecodeStack, int]] = {}  # layer -> (stack, offset)
        self._attention_rows = 0  # the fused attention layers run below this many rows
        self._expert_rows = 0  # the shard's fused experts below this many rows per expert
        self._head: StackHead | None = None  # the LM head, where the last stack can run it
        # (h, its logits [T, V], their argmax [T]) from the last call's head; then (the logits
        # handed out, their argmax)
        self._logits: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._argmax: tuple[torch.Tensor, torch.Tensor] | None = None
        # the last call's burst: its tokens [steps, T] int64 and logits [steps, T, V] float32
        self._burst: tuple[torch.Tensor, torch.Tensor] | None = None

    def applies(self, mb: MicroBatch) -> bool:
        """Whether this step's micro-batch runs its stacks (checked once a step)."""
        meta, T = mb.meta, mb.token_ids.shape[0]
        dtype = self.model.embed_w.dtype  # the hidden state's, from the first layer on
        if meta.num_decode != T or meta.decode_blocks is None or dtype != torch.bfloat16:
            return False
        shard = self.ffn.inline_shard()
        if shard is None:
            return False
        if shard[0] is not self._built_for:
            self._build(shard[0])
        if not self._stacks or T >= self._attention_rows:
            return False
        return T * self.model.cfg.top_k // self.model.cfg.num_experts < self._expert_rows

    def run(
        self, layer: int, h: torch.Tensor | None, mb: MicroBatch
    ) -> tuple[int, torch.Tensor, Pending | None] | None:
        """Where `layer` is one of a stack's (and `applies` said yes this step): h [T, H], the
        layer's input, or None at layer 0 (the call embeds mb's tokens) -> (the next layer to
        run, its input h [T, H], the FFN work of the layer before it in flight or None); else
        None (the caller runs the layer). The call runs from `layer` to the stack's end: after
        a tie left one layer to torch, the stack goes on from the next (without topk.c, at
        batch 32 most steps had a tie in some layer)."""
        found = self._within.get(layer)
        if found is None:
            return None
        stack, offset = found
        meta, end, T = mb.meta, layer + stack.num_layers - offset, mb.token_ids.shape[0]
        head = self._head if self._runs_head(end, T, mb) else None
        self._logits = self._argmax = self._burst = None
        embed = None
        if h is None:
            table = self.model.embed_w
            if table.is_contiguous() and table.device.type == "cpu":
                embed = (mb.token_ids, table)
            else:
                h = self.model.embed(mb.token_ids)
        # a burst: steps in one call, each from the tokens the last one chose (burst.py), its
        # sampled rows drawn in the call from uniforms drawn here
        steps = mb.burst if embed is not None and head is not None and offset == 0 else 1
        draws = Draws.of([s.request.sampling for s in mb.seqs], steps) if steps > 1 else None
        try:
            r = stack(
                h, meta.positions, meta.slots, meta.decode_blocks, meta.decode_lens, offset, head,
                embed, steps, draws,
            )  # fmt: skip
        except ExpertsFailed as e:
            _, address = self.ffn.inline_shard() or (None, "in process")
            why = f"FFN shard {address} failed layer {layer + e.layer}: internal: {e}"
            raise TransportError(why) from e
        ffn, model = self.ffn, self.model
        n = len(r.tokens) if r.tokens is not None else 1
        if n > 1:  # every step's routing by layer: [L, n * T, k]; a run of a layer per stamp
            ids = r.ids.view(n, r.done, T, -1).transpose(0, 1).reshape(r.done, n * T, -1)
            ffn.ran_inline(layer, ids, r.stamps, tokens=T)
            self._burst = (r.tokens, r.step_logits)
        else:
            ffn.ran_inline(layer, r.ids[: r.done], r.stamps[: r.done])
        if layer + r.done == end:
            if r.head_logits is not None and r.head_argmax is not None:
                self._logits = (r.h, r.head_logits, r.head_argmax)
            return end, r.h, None
        # this layer: attention ran, its routing is torch's (a tie), its experts are sent
        at = layer + r.done
        ids, weights = model.route_fn(r.logits, model.cfg, model.layers[at].router_bias)
        return at + 1, r.h_attn, ffn.send(at, 0, r.x, ids, weights)

    def take_burst(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's burst, once: (tokens [steps, T] int64, logits [steps, T, V] float32),
        steps > 1, each step's token for every row (in the micro-batch's order: a greedy row's
        argmax, a sampled row's draw) and the logits it was chosen from; else None."""
        found, self._burst = self._burst, None
        return found

    def take_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """The logits [T, V] float32 the last call's head computed for exactly this final hidden
        h (the tensor it returned), once; else None (the caller runs model.logits)."""
        found, self._logits = self._logits, None
        if found is None or found[0] is not h:
            return None
        self._argmax = found[1:]
        return found[1]

    def argmax_of(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax [T] int64 of exactly these logits (the tensor `take_logits` handed
        out, as the head wrote it: the caller has not changed it since), computed in the call
        while the logits were in cache; else None."""
        found = self._argmax
        return found[1] if found is not None and found[0] is logits else None

    def _runs_head(self, end: int, T: int, mb: MicroBatch) -> bool:
        """Whether a call ending before layer `end` runs the LM head: it ends the model, every
        row is sampled (the head takes h as it is) and the head's matmul is afd's at T rows."""
        head = self.model.lm_head
        return (
            self._head is not None
            and end == self.model.cfg.num_layers
            and mb.samples_all
            and head.ours(T)
        )

    def _head_for(self, stack: NativeDecodeStack) -> StackHead | None:
        """The LM head as a stack call runs it: a bf16 weight laid out for the stack's matmuls
        or a block-FP8 one converted by them, no bias, and a bf16 final norm; else None."""
        head, model = self.model.lm_head, self.model
        norm = model.final_norm
        if head.mx is not None or head.bias is not None or head.kernel_path is None:
            return None
        if gemm.ISAS[head.kernel_path] != stack.isa or head.in_features != stack.hidden:
            return None
        if norm.dtype != torch.bfloat16 or not norm.is_contiguous():
            return None
        w = head.w
        if head.fp8 is not None:  # the codes on the CPU (fp8_block: None where not)
            return StackHead(norm, model.cfg.rms_norm_eps, w) if fp8_block(w) else None
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not w.is_contiguous():
            return None
        return StackHead(norm, model.cfg.rms_norm_eps, w)

    def _build(self, serving) -> None:
        self._built_for, self._stacks, self._within = serving, {}, {}
        model, cache = self.model, self.cache
        runs: list[list[LayerParts]] = [[]]
        starts = [0]
        attention_rows = expert_rows = 1 << 30
        for i, lw in enumerate(model.layers):
            experts = serving.inline_experts(i)
            count = 0 if experts is None or experts.native is None else experts.native.count
            fits = (
                lw.fused is not None
                and experts is not None
                and cache.k[i].dtype == torch.bfloat16
                and count == lw.fused.experts  # the whole layer: one shard (dense: none)
            )
            if not fits:
                runs.append([])
                starts.append(i + 1)
                continue
            cos, sin = lw.kind.rope.tables(torch.bfloat16)
            k, v, scale = cache.k[i], cache.v[i], lw.kind.scale
            index = cache.index[i] if getattr(lw.fused, "indexed", False) else None  # DSA's keys
            parts = LayerParts(
                lw.fused, experts.native, experts.first, k, v, cos, sin, scale, experts.shared,
                index,
            )  # fmt: skip
            runs[-1].append(parts)
            attention_rows = min(attention_rows, lw.o_proj.onednn_from, lw.fused.rows_below)
            if experts.shared is not None:  # the shared (dense) MLP's matmuls take every row
                attention_rows = min(attention_rows, experts.shared_rows_below)
            expert_rows = min(expert_rows, experts.rows_below)
        self._head = None
        for start, parts in zip(starts, runs, strict=True):
            if parts and NativeDecodeStack.usable(parts):
                stack = self._stacks[start] = NativeDecodeStack(parts)
                for offset in range(len(parts)):
                    self._within[start + offset] = (stack, offset)
                if start + len(parts) == model.cfg.num_layers:
                    self._head = self._head_for(stack)
        self._attention_rows, self._expert_rows = attention_rows, expert_rows
