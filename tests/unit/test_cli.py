"""The `afd` command line: `afd bench` hands everything after it to the benchmarks' own parser,
which every other command never builds (its modules import the services and torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from afd_cli.main import main


def test_bench_help_lists_the_benchmarks(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(b in out for b in ("engine", "serve", "context", "weights", "wire"))


def test_bench_wire_takes_its_own_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "wire", "--help"])
    assert e.value.code == 0 and "--tokens" in capsys.readouterr().out


def test_other_commands_still_refuse_unknown_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["gateway", "--attention", "a:1", "--bogus"])
    assert e.value.code == 2 and "--bogus" in capsys.readouterr().err


def test_building_the_command_line_loads_no_benchmark():
    code = (
        "import sys; from afd_cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith('afd_cli.bench')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
