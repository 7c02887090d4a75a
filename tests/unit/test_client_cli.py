"""`afd chat` / `afd complete` where no server answers: one line naming the cause, status 2."""

from __future__ import annotations

import socket

from afd_cli.main import main


def test_an_unreachable_server_is_one_line(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for command in ("chat", "complete"):
        assert main([command, "-q", "hi", "--url", f"http://127.0.0.1:{port}/v1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot reach the server at http://127.0.0.1:{port}/v1")
        assert err.count("\n") == 1
