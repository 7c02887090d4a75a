"""`afd serve`'s supervisor against fake children: a death is restarted after a backoff that
doubles, a crash loop stops the cluster with a message naming the child and why it ended."""

from __future__ import annotations

import threading
import time

import pytest

from afd_cli import supervisor as sup
from afd_cli.cluster import Child
from afd_cli.supervisor import Supervisor, cause


class FakeProc:
    def __init__(self):
        self.code = None

    def poll(self):
        return self.code


class FakeCluster:
    def __init__(self, *names):
        self.children = [Child(n, ["x"], proc=FakeProc()) for n in names]
        self.launched: list[str] = []
        self.lock = threading.Lock()

    def launch(self, child):
        self.launched.append(child.name)
        child.proc = FakeProc()


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(sup, "FIRST_BACKOFF_S", 0.02)
    monkeypatch.setattr(sup, "MAX_BACKOFF_S", 0.08)


def _until(s: Supervisor, cluster: FakeCluster, n: int, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while len(cluster.launched) < n:
        assert s.check() is None
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_dead_child_is_restarted_after_a_backoff_and_the_others_are_left_alone():
    cluster = FakeCluster("ffn-0", "attention-0", "gateway")
    s = Supervisor(cluster, max_restarts=5, window_s=60)
    assert s.check() is None and not cluster.launched
    cluster.children[0].proc.code = -9
    t0 = time.monotonic()
    assert s.check() is None and not cluster.launched  # not at once: after the backoff
    _until(s, cluster, 1)
    assert time.monotonic() - t0 >= 0.02
    assert cluster.launched == ["ffn-0"] and s.restarted == {"ffn-0": 1}
    cluster.children[0].proc.code = 1  # again: the backoff doubles
    t1 = time.monotonic()
    _until(s, cluster, 2)
    assert time.monotonic() - t1 >= 0.04


def test_a_crash_loop_stops_the_cluster_and_says_why():
    cluster = FakeCluster("ffn-0", "gateway")
    s = Supervisor(cluster, max_restarts=2, window_s=60)
    for n in (1, 2):
        cluster.children[0].proc.code = -9
        _until(s, cluster, n)
    cluster.children[0].proc.code = 3
    why = s.check()
    assert why is not None and "ffn-0" in why and "exit code 3" in why and "crash-looping" in why


def test_restarts_older_than_the_window_do_not_count():
    cluster = FakeCluster("attention-0")
    s = Supervisor(cluster, max_restarts=1, window_s=0.05)
    cluster.children[0].proc.code = -15
    _until(s, cluster, 1)
    time.sleep(0.06)  # the restart has left the window
    cluster.children[0].proc.code = -15
    _until(s, cluster, 2)


def test_no_restarts_means_the_first_death_stops_the_cluster():
    cluster = FakeCluster("gateway")
    cluster.children[0].proc.code = -9
    why = Supervisor(cluster, max_restarts=0, window_s=60).check()
    assert why is not None and "killed by SIGKILL" in why and not cluster.launched


def test_cause_names_signals_and_exit_codes():
    assert cause(-9) == "killed by SIGKILL" and cause(2) == "exit code 2"


def test_auto_topology_disaggregates_only_where_each_process_gets_two_cores():
    from afd_cli.cluster import topology

    assert topology("auto", 1, 1, 2) == "inproc"  # a 2-core box: one process, both cores
    assert topology("auto", 1, 1, 3) == "inproc"
    assert topology("auto", 1, 1, 4) == "tcp"
    assert topology("auto", 2, 2, 6) == "inproc" and topology("auto", 2, 2, 8) == "tcp"
    assert topology("grpc", 1, 1, 2) == "grpc"  # what a user asks for is kept
    # both roles on one GPU: one process, whatever the cores (one plan of the device's memory)
    assert topology("auto", 1, 1, 16, one_gpu=True) == "inproc"
    assert topology("tcp", 1, 1, 16, one_gpu=True) == "tcp"
    assert topology("auto", 1, 1, 16, elastic=True, one_gpu=True) == "tcp"


def test_serve_in_one_process_hands_hidden_states_over_in_bf16():
    from afd_cli.cluster import Cluster, ClusterConfig

    def attention_argv(**kw):
        (child,) = [c for c in Cluster(ClusterConfig(**kw)).plan() if c.name == "attention-0"]
        return child.argv

    argv = attention_argv(transport="inproc")
    assert argv[argv.index("--a2f-dtype") + 1] == "bf16"
    assert "--a2f-dtype" not in attention_argv(transport="tcp")  # the engine's default: fp8
    asked = attention_argv(transport="inproc", engine_args=("--a2f-dtype", "fp8"))
    assert asked.count("--a2f-dtype") == 1  # what the user asked for stands


def test_a_flag_given_at_its_default_is_passed_on():
    """`afd serve --transport inproc --a2f-dtype fp8`: fp8 is the engine's default, but the user
    asked for it, so the in-process bf16 hand-over must not replace it (it once did: flags left
    at their default were not forwarded, so the launcher could not tell)."""
    from afd_cli.cluster import Cluster
    from afd_cli.main import build_parser
    from afd_cli.serve import config

    args = build_parser().parse_args(["serve", "--transport", "inproc", "--a2f-dtype", "fp8"])
    (child,) = [c for c in Cluster(config(args)).plan() if c.name == "attention-0"]
    assert child.argv[child.argv.index("--a2f-dtype") + 1] == "fp8"
    assert child.argv.count("--a2f-dtype") == 1
    argv = ["serve", "--transport", "tcp", "--expert-compute", "direct", "--quantization", "fp8"]
    plan = Cluster(config(build_parser().parse_args(argv))).plan()
    ffn = [c for c in plan if c.name.startswith("ffn-")]
    assert ffn and all(c.argv[c.argv.index("--expert-compute") + 1] == "direct" for c in ffn)
    # the weights quantized as they load in every server that holds some (vLLM's flag)
    for c in plan:
        assert ("--quantization" in c.argv) == (c.name != "gateway"), c.name
        if c.name != "gateway":
            assert c.argv[c.argv.index("--quantization") + 1] == "fp8"


def test_an_elastic_pool_is_ffn_processes_that_hold_every_expert_read_from_a_file():
    from afd.errors import ConfigError
    from afd_cli.cluster import Cluster, ClusterConfig, topology

    assert topology("auto", 1, 1, 2, elastic=True) == "tcp"  # processes join and leave
    cluster = Cluster(ClusterConfig(elastic_ffn=True, ffn=2))
    try:
        children = {c.name: c for c in cluster.plan()}
        assert cluster.pool_file is not None
        assert cluster.pool_file.read_text().split() == cluster.ffn_addresses
        assert not any("--shard" in children[f"ffn-{i}"].argv for i in range(2))
        att = children["attention-0"].argv
        assert att[att.index("--ffn-pool") + 1] == f"file:{cluster.pool_file}"
        assert "--ffn" not in att
    finally:
        cluster.stop()  # removes its temporary directory
    with pytest.raises(ConfigError, match="network transport"):
        ClusterConfig(elastic_ffn=True, transport="inproc")
    with pytest.raises(ConfigError, match="API key"):
        ClusterConfig(elastic_ffn=True, admin_port=9000)
    with pytest.raises(ConfigError, match="--elastic-ffn"):
        ClusterConfig(admin_port=9000, api_key="k")
