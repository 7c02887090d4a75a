"""Structured outputs without the optional xgrammar: a guided request is refused with the
package to install, and free-text requests never touch it."""

from __future__ import annotations

import sys

import pytest

from afd.config import ModelConfig
from afd.control import SamplingParams
from afd.errors import RequestError
from services.attention.guides import Guides
from services.attention.request import Request


def test_without_xgrammar_a_guided_request_names_what_to_install(qwen3_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now fails
    guides = Guides(ModelConfig.from_hf(qwen3_dir))
    guides.start(Request("free", [1, 2], SamplingParams()))  # nothing to do, nothing imported
    with pytest.raises(RequestError, match=r"pip install 'afd\[structured\]'"):
        guides.start(Request("r", [1, 2], SamplingParams(guide_kind="regex", guide="a+")))
    assert not guides.active
