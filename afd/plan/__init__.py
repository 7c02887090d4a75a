"""`afd plan`: the Step-3 decoding-cost model and an attention/FFN deployment planner.

Pure computation (no torch): model arithmetic (`arithmetic`), a hardware catalog (`hardware`),
the paper's cost model (`cost`), the xAyF planner (`planner`) and a reader of a live cluster's
Prometheus metrics (`metrics_input`). `cli.add_parser` / `cli.run` are the command-line face.
"""

from afd.plan.arithmetic import TokenArith, arithmetic_intensity, param_counts, token_arith
from afd.plan.cost import CostAssumptions, cost_table
from afd.plan.errors import PlanError
from afd.plan.hardware import Hardware, load_catalog
from afd.plan.models import PRESETS, ModelArith, from_model_config, resolve_model

__all__ = [
    "PRESETS",
    "CostAssumptions",
    "Hardware",
    "ModelArith",
    "PlanError",
    "TokenArith",
    "arithmetic_intensity",
    "cost_table",
    "from_model_config",
    "load_catalog",
    "param_counts",
    "resolve_model",
    "token_arith",
]
