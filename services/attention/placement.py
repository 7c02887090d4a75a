"""Expert placement over an elastic FFN pool: which member computes which (token, expert) pair.

In an elastic pool every FFN server holds every routed expert (`--shard 0/1`, the default), so
placement moves no weights: it is the attention side's choice, per layer, of the member that
computes each expert, carried in each message (the expert ids a member is not to compute are
sent as -1). It is recomputed between steps when the pool's live members change, so the
messages of a step all go out, and come back, under one placement.

Per layer, experts go to members greedily by load, heaviest first, each to the member with the
least load so far (the longest-processing-time rule); with no load counted yet, contiguous
ranges of equal size. Then the `hot` heaviest experts of the layer get a second member (the
least loaded other one) and their tokens alternate between the two. One member, the first,
also computes the shared expert and the dense layers' MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NOT_HERE = -1  # an expert id that the receiving member does not compute


@dataclass(frozen=True)
class Placement:
    members: int  # live members, indexed 0 .. members - 1
    table: torch.Tensor  # [L, E, 2] long: each expert's two members (the same one twice if single)
    dense_owner: int = 0

    @staticmethod
    def compute(
        members: int,
        num_layers: int,
        num_experts: int,
        load: torch.Tensor | None = None,
        hot: int = 0,
    ) -> Placement:
        """`load`: [L, E] tokens routed to each expert so far (None: nothing counted yet)."""
        if members < 1:
            raise ValueError("a placement needs at least one member")
        table = torch.empty(num_layers, num_experts, 2, dtype=torch.long)
        for layer in range(num_layers):
            counts = None if load is None else load[layer].tolist()
            table[layer] = _layer(members, num_experts, counts, hot)
        return Placement(members, table)

    def assign(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """The member computing each pair: [T, k] expert ids -> [T, k] member indices."""
        pair = self.table[layer][ids.long()]  # [T, k, 2]
        odd = (torch.arange(ids.shape[0]) % 2).view(-1, 1, 1).expand(-1, ids.shape[1], 1)
        return pair.gather(2, odd).squeeze(2)


def _layer(members: int, num_experts: int, counts: list[int] | None, hot: int) -> torch.Tensor:
    out = torch.empty(num_experts, 2, dtype=torch.long)
    if not counts or not any(counts):
        for e in range(num_experts):  # contiguous ranges, the first ones one larger
            out[e] = e * members // num_experts
        return out
    totals = [0.0] * members
    for e in sorted(range(num_experts), key=lambda e: (-counts[e], e)):
        m = min(range(members), key=lambda m: (totals[m], m))
        out[e] = m
        totals[m] += counts[e]
    if members > 1:
        for e in sorted(range(num_experts), key=lambda e: (-counts[e], e))[:hot]:
            if not counts[e]:
                break
            first = int(out[e, 0])
            second = min((m for m in range(members) if m != first), key=lambda m: (totals[m], m))
            out[e, 1] = second
            totals[first] -= counts[e] / 2
            totals[second] += counts[e] / 2
    return out
