"""The family registry (afd/families): every family is complete, resolvable and reference-tested.

A family is one registry entry; these tests hold each entry to the whole contract: its module
is imported by the package, its config.json parses, its weight-name map covers every tensor the
config implies, its kinds exist in the services' registries, and a greedy-vs-reference test
runs it (tests/helpers/checkpoints.py: REFERENCE_CHECKPOINTS).
"""

from __future__ import annotations

import json
import pkgutil
import sys
from dataclasses import replace

import pytest

import afd.families
from afd.checkpoint import expected_shapes, loaded_names, strip_prefix, tensor_files
from afd.config import ModelConfig
from afd.errors import ConfigError
from afd.families import FAMILIES, family, register
from services.attention.kinds import ATTENTION_KINDS
from services.attention.moe_router import ROUTERS
from services.ffn.kinds import FFN_KINDS
from tests.helpers.checkpoints import DENSE_REFERENCES, REFERENCE_CHECKPOINTS

NOT_FAMILIES = {"base", "fields", "names"}  # the package's own modules


def unreferenced() -> set[str]:
    """Families without a greedy-vs-reference test, and reference checkpoints of no family."""
    return set(FAMILIES) ^ set(REFERENCE_CHECKPOINTS)


def test_every_family_has_a_greedy_reference_test():
    assert not unreferenced(), (
        "each registered family needs a tiny checkpoint in tests/helpers/checkpoints.py "
        "REFERENCE_CHECKPOINTS (checked against transformers, or a dense reference of our own "
        f"in DENSE_REFERENCES); mismatched: {sorted(unreferenced())}"
    )
    assert set(DENSE_REFERENCES) <= set(REFERENCE_CHECKPOINTS)


def test_the_reference_check_sees_a_family_without_one(monkeypatch):
    dummy = replace(FAMILIES["mixtral"], model_type="dummy_moe")
    monkeypatch.setitem(FAMILIES, "dummy_moe", dummy)
    assert unreferenced() == {"dummy_moe"}


def test_every_family_module_is_imported_by_the_package():
    modules = {m.name for m in pkgutil.iter_modules(afd.families.__path__)} - NOT_FAMILIES
    for name in modules:  # a module the package does not import never registers its family
        module = sys.modules.get(f"afd.families.{name}")
        assert module is not None, f"afd/families/__init__.py does not import {name}"
        assert FAMILIES[module.FAMILY.model_type] is module.FAMILY
    assert len(FAMILIES) == len(modules)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_kinds_resolve_in_the_services_registries(model_type):
    f = family(model_type)
    assert f.model_type == model_type
    assert f.attention in ATTENTION_KINDS
    assert f.router in ROUTERS
    assert f.ffn in FFN_KINDS


def test_a_model_type_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        register(FAMILIES["mixtral"])


@pytest.mark.parametrize("model_type", ["llama", None, ["qwen3_moe"]])
def test_unsupported_model_type_names_the_supported_ones(model_type):
    with pytest.raises(ConfigError, match=r"unsupported model_type .*; afd serves: ") as e:
        ModelConfig.from_dict({"model_type": model_type, "hidden_size": 8})
    assert all(mt in str(e.value) for mt in FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_parses_its_config_and_maps_every_tensor(model_type, tmp_path):
    path = REFERENCE_CHECKPOINTS[model_type](tmp_path / "ckpt")
    cfg = ModelConfig.from_hf(path)
    f = family(model_type)
    assert (cfg.model_type, cfg.attention, cfg.router, cfg.ffn) == (
        model_type,
        f.attention,
        f.router,
        f.ffn,
    )
    assert len(cfg.moe_layers) == cfg.num_layers and any(cfg.moe_layers)
    mapped: set[str] = set()
    for key in tensor_files(path):
        name = f.weights.canonical(strip_prefix(key, cfg.weight_prefix))
        assert name is not None, f"{model_type}: {key} maps to no canonical name"
        stacked = "*" in name
        for one in loaded_names(name):
            mapped |= (
                {one.replace("*", str(e)) for e in range(cfg.num_experts)} if stacked else {one}
            )
    assert mapped == set(expected_shapes(cfg))


def test_missing_and_malformed_fields_name_the_family_and_field(tmp_path):
    path = REFERENCE_CHECKPOINTS["step3_text"](tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"config.json \(step3_text\) is missing .*'share_q_dim'"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "share_q_dim"})
    with pytest.raises(ConfigError, match=r"\(step3_text\) has a malformed field: moe_layers_enum"):
        ModelConfig.from_dict({**raw, "moe_layers_enum": "1,99"})


def test_a_vision_language_wrapper_serves_its_text_family():
    raw = {"model_type": "step3_vl", "text_config": {"model_type": "mixtral"}}
    with pytest.raises(ConfigError, match=r"\(mixtral\) is missing required field"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="text_config without a model_type"):
        ModelConfig.from_dict({"model_type": "step3_vl", "text_config": {}})


def test_weight_names_map_a_stacked_expert_tensor_and_skip_unknown_ones():
    names = family("step3_text").weights
    assert names.canonical("model.layers.2.moe.up_proj.weight") == "layers.2.experts.*.up"
    assert names.canonical("model.layers.0.share_expert.down_proj.weight") == "layers.0.shared.down"
    assert names.canonical("model.layers.0.mlp.experts.1.up_proj.weight") is None  # not Step-3's
    assert names.canonical("model.rotary_emb.inv_freq") is None
    mixtral = family("mixtral").weights
    assert mixtral.canonical("model.layers.1.block_sparse_moe.experts.5.w3.weight") == (
        "layers.1.experts.5.up"
    )
