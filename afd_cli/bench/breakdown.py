"""Where a decode step's time goes: the engine's native calls against the rest (Python, torch).

`afd bench engine` reports it for batch 1 next to the memory bound, so that the distance to the
bound can be split into what the kernels take and what the step spends around them. The calls
are timed by wrapping, for the length of one measurement, the methods that make them; the
wrappers' own time lands in the rest.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

# the timed calls' keys
KERNELS = ("decode_stacks", "fused_experts", "fused_decode_layers", "matmuls")


@contextmanager
def timed(owner: object, name: str, key: str, totals: Counter) -> Iterator[None]:
    """While open, every call of owner.name adds its wall time to totals[key]."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _targets() -> list[tuple[object, str, str]]:
    """(class, method, key): the native calls of a decode step, and the step itself."""
    from afd.kernels.decode_layer import NativeDecodeLayer
    from afd.kernels.decode_stack import NativeDecodeStack
    from afd.kernels.moe import NativeExperts
    from afd.ops import Linear
    from services.attention.engine import Engine

    return [
        # layers with attention + experts, and the LM head where the call ends the model
        (NativeDecodeStack, "__call__", "decode_stacks"),
        (NativeExperts, "__call__", "fused_experts"),
        (NativeDecodeLayer, "__call__", "fused_decode_layers"),
        (Linear, "_matmul", "matmuls"),  # the LM head where the stack does not run it
        (Engine, "step", "step"),
    ]


def step_breakdown(
    generate: Callable[[int], object],
    new: int,
    targets: list[tuple[object, str, str]] | None = None,
) -> dict[str, float]:
    """Milliseconds per decode step: `generate(n)` decodes n tokens from the same prompts; the
    one-token run (the prefill and the first token) is subtracted from the `new`-token run.
    Keys: step, the KERNELS, rest (the step less the KERNELS).
    `targets` replaces the engine's methods (for tests); its keys must be those."""
    runs = []
    for n in (1, new):
        totals: Counter = Counter()
        with ExitStack() as stack:
            for owner, name, key in targets or _targets():
                stack.enter_context(timed(owner, name, key, totals))
            generate(n)
        runs.append(totals)
    one, many = runs
    per_step = {k: (many[k] - one[k]) / (new - 1) * 1e3 for k in ("step", *KERNELS)}
    per_step["rest"] = per_step["step"] - sum(per_step[k] for k in KERNELS)
    return {k: round(v, 3) for k, v in per_step.items()}
