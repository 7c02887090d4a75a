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


@pytest.mark.parametrize(
    "argv", [["gateway", "--help"], ["--log-level", "DEBUG", "keys", "--help"]]
)
def test_a_command_that_needs_no_torch_starts_without_it(argv):
    """`afd serve` restarts a dead gateway with `afd gateway ...`: building every command's
    parser would import the services and torch first (seconds on a busy box)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from afd_cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    sys.exit(e.code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: afd" in out.stdout


def test_the_full_command_line_still_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert all(c in out for c in ("generate", "ffn", "attention", "gateway", "serve", "bench"))


def test_bench_engine_refuses_a_run_with_no_decode_to_time(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "engine", "--new-tokens", "1"])
    assert e.value.code == 2 and "--new-tokens: must be >= 2" in capsys.readouterr().err
