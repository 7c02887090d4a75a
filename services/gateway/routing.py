"""Which attention server a request goes to: prefix-aware by default, with a load guard.

An attention server's prefix cache only helps the requests that reach it, so requests whose
prompts start alike should meet on one server. The routing key is the content hash of the
prompt's first `prefix_tokens` tokens, in whole blocks of `BLOCK` (a shorter prompt: its whole
blocks, or all of it below one block); the key's owner is found on a consistent-hash ring
(every server at `VNODES` points), so adding or removing a server moves only the keys that
fall to or from it. A server that is down, draining or excluded is skipped: the key goes to the
next server along the ring.

The load guard: when the owner's load exceeds the least-loaded server's by more than
`balance_abs` requests and by more than the factor `balance_ratio`, the request goes to the
least-loaded server instead (which then computes the prefix once and holds it too). Load is
what the balancer counts: running + waiting requests (the server's report or this gateway's
open streams, whichever is larger), KV usage breaking ties.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from afd import prefix
from afd.config import check

POLICIES = ("prefix", "least-loaded", "round-robin")
BLOCK = 16  # tokens per routing block (the attention servers' default KV block size)
VNODES = 64  # ring points per server: spreads keys evenly between a few servers


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix"  # prefix | least-loaded | round-robin
    prefix_tokens: int = 256  # tokens of the prompt's start that make its routing key
    balance_abs: float = 4.0  # the owner may carry this many more requests than the idlest...
    balance_ratio: float = 1.5  # ... or this factor more, before the idlest server takes over

    def __post_init__(self) -> None:
        check(
            self.policy in POLICIES,
            f"routing policy must be one of {POLICIES}, got {self.policy!r}",
        )
        check(self.prefix_tokens >= 1, f"prefix tokens must be >= 1, got {self.prefix_tokens}")
        check(
            self.balance_abs >= 0 and self.balance_ratio >= 1,
            f"balance_abs must be >= 0 and balance_ratio >= 1, got {self.balance_abs} and "
            f"{self.balance_ratio}",
        )


def routing_key(prompt: Sequence[int], prefix_tokens: int) -> bytes:
    """The content hash of the prompt's first `prefix_tokens` tokens, in whole blocks."""
    n = min(len(prompt), prefix_tokens)
    if n >= BLOCK:
        return prefix.extend([], prompt, BLOCK, n // BLOCK)[-1]
    return prefix.chain(prefix.root(b"short"), prompt[:n])


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Ring:
    """A consistent-hash ring of server names."""

    def __init__(self, names: Sequence[str], vnodes: int = VNODES) -> None:
        points = sorted(
            (_point(f"{name}#{v}".encode()), i)
            for i, name in enumerate(names)
            for v in range(vnodes)
        )
        self._keys = [p for p, _ in points]
        self._owners = [i for _, i in points]
        self._n = len(names)

    def order(self, key: bytes) -> list[int]:
        """Every server's index, in ring order from the key's point: the owner first, then
        whoever takes over when the ones before are skipped."""
        start = bisect.bisect(self._keys, _point(key))
        seen: list[int] = []
        for j in range(len(self._owners)):
            i = self._owners[(start + j) % len(self._owners)]
            if i not in seen:
                seen.append(i)
                if len(seen) == self._n:
                    break
        return seen
