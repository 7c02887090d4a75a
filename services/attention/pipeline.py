"""Micro-batch pipelining: a bounded set of in-flight FFN messages inside the layer loop.

With S micro-batches, layer l of micro-batch m waits only for m's own FFN reply of layer l-1;
while that reply is computed on the FFN side (or on the wire), the attention side works on
the other micro-batches. S = 1 is the serial baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.attention.batch import MicroBatch
from services.attention.dispatch import FFNDispatcher, Pending
from services.attention.kv_cache import KVCache
from services.attention.model import AttentionModel
from services.attention.stack import DecodeStack


def run_layers(
    model: AttentionModel,
    cache: KVCache,
    ffn: FFNDispatcher,
    mbs: list[MicroBatch],
    finish: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    stack: DecodeStack | None = None,
) -> list[torch.Tensor]:
    """The decoder stack over all micro-batches; returns each one's final hidden [T_m, H], or
    with `finish`, finish(m, hidden) for each. finish runs on micro-batch m as soon as its last
    FFN reply is in, while the later micro-batches' last replies are still being computed: with
    the LM head there, all but the last micro-batch's LM head overlaps the FFN side's work.
    With `stack` and one micro-batch, each run of layers that can be one native call is one
    (stack.py) and the loop runs the others."""
    pending: list[Pending | None] = [None] * len(mbs)
    try:
        if stack is not None and len(mbs) == 1 and stack.applies(mbs[0]):
            h = _run_stacked(model, cache, ffn, mbs[0], stack)
            return [finish(0, h) if finish is not None else h]
        hs = [model.embed(mb.token_ids) for mb in mbs]
        for layer in range(model.cfg.num_layers):
            for m, mb in enumerate(mbs):
                if pending[m] is not None:
                    hs[m] = hs[m] + ffn.collect(pending[m])
                hs[m], x, ids, weights = model.attention_and_route(layer, hs[m], mb.meta, cache)
                pending[m] = ffn.send(layer, m, x, ids, weights)
        for m in range(len(mbs)):
            hs[m] = hs[m] + ffn.collect(pending[m])
            if finish is not None:
                hs[m] = finish(m, hs[m])
    except BaseException:
        ffn.reset()  # replies of the abandoned step must not be matched to the next one
        raise
    return hs


def _run_stacked(
    model: AttentionModel,
    cache: KVCache,
    ffn: FFNDispatcher,
    mb: MicroBatch,
    stack: DecodeStack,
) -> torch.Tensor:  # [T, H]
    """One micro-batch's layers, each run of them that is one native call as that call (the
    first embeds the tokens where it starts at layer 0)."""
    pending: Pending | None = None
    h: torch.Tensor | None = None  # [T, H]
    layer = 0
    while layer < model.cfg.num_layers:
        if pending is not None:
            assert h is not None
            h, pending = h + ffn.collect(pending), None
        ran = stack.run(layer, h, mb)
        if ran is not None:
            layer, h, pending = ran
            continue
        if h is None:
            h = model.embed(mb.token_ids)
        h, x, ids, weights = model.attention_and_route(layer, h, mb.meta, cache)
        pending = ffn.send(layer, 0, x, ids, weights)
        layer += 1
    return h if pending is None else h + ffn.collect(pending)
