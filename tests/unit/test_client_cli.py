"""`afd chat` / `afd complete` where no server answers: one line naming the cause, status 2."""

from __future__ import annotations

import io
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


def test_in_a_conversation_a_failed_message_is_said_and_the_rest_goes_on(capsys, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nand then?\n"))
    url = f"http://127.0.0.1:{port}/v1"
    assert main(["chat", "--url", url, "--model-name", "m"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(e.startswith("error: cannot reach the server") for e in err)
