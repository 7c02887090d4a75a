"""Where an elastic FFN pool comes from: a file afd serve rewrites, or a headless Service's DNS."""

from __future__ import annotations

import socket
import time

import pytest

from afd.errors import ConfigError
from services.attention import pool_source
from services.attention.pool_source import PoolSource, write_pool


def test_a_file_pool_is_read_again_when_it_is_time(tmp_path) -> None:
    path = tmp_path / "pool"
    write_pool(path, ["tcp://b:1", "tcp://a:1"])
    src = PoolSource(f"file:{path}", interval_s=0.05)
    assert src.members(force=True) == ("tcp://a:1", "tcp://b:1")  # sorted
    path.write_text("tcp://a:1  # the first\n\n# gone: tcp://b:1\ntcp://c:1\n")
    assert src.members() is None  # not yet time to look
    time.sleep(0.06)
    assert src.members() == ("tcp://a:1", "tcp://c:1")
    path.unlink()  # unreadable now: the last pool read stands
    time.sleep(0.06)
    assert src.members() == ("tcp://a:1", "tcp://c:1")


def test_a_dns_pool_lists_every_address_the_name_resolves_to(monkeypatch) -> None:
    answers = {"now": ["10.0.0.2", "10.0.0.1"]}

    def fake(host, port, type=0):
        assert (host, port) == ("afd-ffn-pool", 5600)
        if answers["now"] is None:
            raise socket.gaierror(socket.EAI_AGAIN, "temporary failure")
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in answers["now"]]

    monkeypatch.setattr(pool_source.socket, "getaddrinfo", fake)
    src = PoolSource("dns:tcp://afd-ffn-pool:5600", interval_s=0.02)
    assert src.members(force=True) == ("tcp://10.0.0.1:5600", "tcp://10.0.0.2:5600")
    answers["now"] = ["10.0.0.3"]  # scaled: one pod replaced by another
    deadline = time.monotonic() + 5
    while src.members() != ("tcp://10.0.0.3:5600",):  # the resolver thread's answer
        assert time.monotonic() < deadline
        time.sleep(0.02)
    answers["now"] = None  # DNS fails: the pool stays as it was
    time.sleep(0.1)
    assert src.members(force=False) in (None, ("tcp://10.0.0.3:5600",))
    assert src._last == ("tcp://10.0.0.3:5600",)


def test_bad_specs_name_the_form_expected() -> None:
    for spec in ("tcp://a:1", "file:", "dns:afd-ffn:5600", "dns:tcp://afd-ffn"):
        with pytest.raises(ConfigError, match="--ffn-pool"):
            PoolSource(spec)
