"""The hardware catalog: shipped as data (`data/hardware.json`), extended from a user's file.

A user file has the shipped file's shape. An entry whose name is already known (any case) is
merged field by field, so `{"L20": {"price_per_hour": 0.5}}` just prices the L20; a new name must
give at least bf16_flops, mem_bandwidth and mem_gib.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from afd.plan.errors import PlanError

GIB = 1024**3
REQUIRED = ("bf16_flops", "mem_bandwidth", "mem_gib")
OPTIONAL = ("price_per_hour", "fp8_flops", "net_gbps", "source")


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float  # dense peak FLOP/s
    mem_bandwidth: float  # bytes/s
    mem_gib: float
    fp8_flops: float | None = None  # None: no FP8 units
    price_per_hour: float | None = None  # USD per chip-hour; None: not public
    net_gbps: float | None = None  # scale-out network per chip, Gbit/s
    source: str = ""

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in `dtype`; FP8 falls back to BF16 on chips without FP8."""
        if dtype == "fp8" and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops

    def compute_dtype(self, preferred: str) -> str:
        return "fp8" if preferred == "fp8" and self.fp8_flops else "bf16"

    @property
    def mem_bytes(self) -> float:
        return self.mem_gib * GIB

    @property
    def net_bytes_per_s(self) -> float | None:
        return self.net_gbps * 1e9 / 8 if self.net_gbps else None

    def require_price(self) -> float:
        if self.price_per_hour is None:
            raise PlanError(
                f"hardware {self.name!r} has no price: give price_per_hour in a --hardware-file"
            )
        return self.price_per_hour


Catalog = dict[str, Hardware]  # keyed by upper-case name


def _positive(name: str, key: str, value: Any, where: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise PlanError(f"{where}: {name}.{key} must be a number (got {value!r})") from None
    if not math.isfinite(v) or v <= 0:
        raise PlanError(f"{where}: {name}.{key} must be positive (got {value!r})")
    return v


def _entry(name: str, raw: Any, base: Hardware | None, where: str) -> Hardware:
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: entry {name!r} must be a JSON object")
    unknown = set(raw) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        raise PlanError(
            f"{where}: entry {name!r} has unknown field(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(REQUIRED + OPTIONAL)}"
        )
    values: dict[str, Any] = (
        {f.name: getattr(base, f.name) for f in fields(Hardware)} if base else {}
    )
    values["name"] = base.name if base else name
    for key in REQUIRED:
        if key in raw:
            values[key] = _positive(name, key, raw[key], where)
        elif key not in values:
            raise PlanError(f"{where}: new hardware {name!r} is missing required field {key!r}")
    for key in ("price_per_hour", "fp8_flops", "net_gbps"):
        if key in raw:
            values[key] = None if raw[key] is None else _positive(name, key, raw[key], where)
    if "source" in raw:
        values["source"] = str(raw["source"])
    return Hardware(**values)


def parse_catalog(raw: Any, where: str, base: Catalog | None = None) -> Catalog:
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: must hold a JSON object of hardware entries")
    out = dict(base or {})
    for name, entry in raw.items():
        if name.startswith("_"):  # comments
            continue
        out[name.upper()] = _entry(name, entry, out.get(name.upper()), where)
    return out


def load_catalog(extra_file: str | Path | None = None) -> Catalog:
    """The shipped catalog, merged with `extra_file` when given."""
    shipped = resources.files("afd.plan").joinpath("data/hardware.json").read_text()
    catalog = parse_catalog(json.loads(shipped), "afd/plan/data/hardware.json")
    if extra_file is None:
        return catalog
    path = Path(extra_file)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"hardware file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"hardware file {str(path)!r} is not readable JSON: {e}") from None
    return parse_catalog(raw, str(path), catalog)


def lookup(catalog: Catalog, name: str) -> Hardware:
    try:
        return catalog[name.strip().upper()]
    except KeyError:
        known = ", ".join(h.name for h in catalog.values())
        raise PlanError(
            f"unknown hardware {name!r}; known: {known} (add it with --hardware-file)"
        ) from None


def lookup_many(catalog: Catalog, names: str | list[str] | tuple[str, ...]) -> list[Hardware]:
    """Comma-separated names (or a list); 'all' = the whole catalog."""
    items = names.split(",") if isinstance(names, str) else list(names)
    items = [n for n in (s.strip() for s in items) if n]
    if not items:
        raise PlanError("no hardware named")
    if [n.lower() for n in items] == ["all"]:
        return list(catalog.values())
    return [lookup(catalog, n) for n in items]
