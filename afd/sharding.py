"""Expert parallelism: which FFN shard owns which experts.

Shards take contiguous, near-equal expert ranges (the first E % N shards get one more), so
any N works, including one that does not divide E. Shard 0 also computes the shared expert
and the dense-layer MLPs: every token's contribution is then counted exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd.errors import ConfigError


@dataclass(frozen=True)
class ExpertShard:
    index: int
    count: int
    num_experts: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ConfigError(f"shard index {self.index} is outside 0..{self.count - 1}")
        if self.count > max(self.num_experts, 1):
            raise ConfigError(
                f"{self.count} shards for {self.num_experts} experts: some would be empty"
            )

    @property
    def start(self) -> int:
        base, rem = divmod(self.num_experts, self.count)
        return self.index * base + min(self.index, rem)

    @property
    def end(self) -> int:
        base, rem = divmod(self.num_experts, self.count)
        return self.start + base + (1 if self.index < rem else 0)

    def owns(self, expert: int) -> bool:
        return self.start <= expert < self.end

    @property
    def owns_dense(self) -> bool:
        return self.index == 0

    @classmethod
    def parse(cls, text: str, num_experts: int) -> ExpertShard:
        """`"i/N"` as given on the command line."""
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError as e:
            raise ConfigError(f"--shard must look like i/N (e.g. 0/2), got {text!r}") from e
        return cls(i, n, num_experts)


def pool_shards(addresses: tuple[str, ...]) -> list[list[str]]:
    """The FFN pool as shards of replicas: the i-th entry serves expert shard i, and an entry
    `a|b` names two replicas of it (either one computes the shard's messages)."""
    return [[a.strip() for a in entry.split("|") if a.strip()] for entry in addresses]
