"""`afd serve` measures oneDNN's crossover once and every child it starts (a restarted one
too) gets that number, so no two processes of one cluster multiply a batch differently."""

from __future__ import annotations

import io

import pytest

from afd.kernels import paths
from afd_cli import cluster as cluster_mod
from afd_cli import measured
from afd_cli.cluster import Child, Cluster, ClusterConfig


@pytest.fixture
def avx512(monkeypatch):
    """The avx512bf16 path active, its crossover 'measured' as 48 rows; the calls recorded."""
    calls: list[int] = []
    monkeypatch.delenv(paths.ROWS_ENV, raising=False)
    monkeypatch.setattr(paths, "active", lambda: paths.PATHS["avx512bf16"])
    monkeypatch.setattr(paths, "onednn_from_rows", lambda t: calls.append(t) or 48)
    return calls


def test_the_crossover_is_measured_with_the_childrens_threads(avx512):
    assert measured.children_env(["cpu", "cpu"], 3) == {paths.ROWS_ENV: "48"}
    assert avx512 == [3]


def test_never_is_passed_on_as_zero(avx512, monkeypatch):
    monkeypatch.setattr(paths, "onednn_from_rows", lambda t: paths.NEVER)
    assert measured.children_env(["cpu"], 2) == {paths.ROWS_ENV: "0"}


def test_nothing_is_measured_where_nothing_reads_it(avx512, monkeypatch):
    monkeypatch.setattr(paths, "active", lambda: paths.PATHS["avx2"])
    assert measured.children_env(["cpu"], 2) == {}
    monkeypatch.setattr(paths, "active", lambda: paths.PATHS["avx512bf16"])
    monkeypatch.setenv(paths.ROWS_ENV, "16")  # the user's number stands, inherited as it is
    assert measured.children_env(["cpu"], 2) == {}
    assert avx512 == []


class FakeProc:
    pid = 4242

    def __init__(self):
        self.stdout = io.BytesIO(b"")


@pytest.fixture
def launched(monkeypatch) -> list[dict[str, str]]:
    """Each Popen's environment, in order (no process is started)."""
    seen: list[dict[str, str]] = []

    def popen(argv, **kw):
        seen.append(kw["env"])
        return FakeProc()

    monkeypatch.setattr(cluster_mod.subprocess, "Popen", popen)
    return seen


def test_start_measures_once_for_every_child(avx512, launched):
    c = Cluster(ClusterConfig(model="m", device="cpu", transport="tcp", ffn=2))
    c.start()
    assert len(launched) == 4  # two FFN servers, the attention server, the gateway
    assert all(e[paths.ROWS_ENV] == "48" for e in launched)
    assert avx512 == [c._threads()]


def test_every_launch_gets_the_clusters_env_and_a_childs_own_wins(launched):
    c = Cluster(ClusterConfig(device="cpu"))
    c.env = {paths.ROWS_ENV: "48"}
    c.launch(Child("ffn-0", ["x"]))
    c.launch(Child("ffn-0", ["x"]))  # the supervisor's restart: the same launch
    c.launch(Child("gateway", ["x"], {paths.ROWS_ENV: "7", "AFD_API_KEY": "k"}))
    assert [e[paths.ROWS_ENV] for e in launched] == ["48", "48", "7"]
    assert launched[2]["AFD_API_KEY"] == "k"
