"""One registry entry per transport backend, chosen by the address scheme.

Adding a backend is one module with `connect(address, **options) -> FFNClient` and
`listen(address, serving, **options) -> Listener` (the contract is in base.py) and one entry
in `_BACKENDS`.
"""

from __future__ import annotations

import importlib

from afd.errors import ConfigError
from afd.transport.base import FFNClient, Listener
from afd.transport.serving import FFNServing

# scheme -> module defining `connect(address) -> FFNClient` and `listen(address, handler)`
_BACKENDS: dict[str, str] = {
    "inproc": "afd.transport.inproc",
    "tcp": "afd.transport.zmq",
    "ipc": "afd.transport.zmq",
    "grpc": "afd.transport.grpc",
}


def _backend(address: str):
    scheme, sep, _ = address.partition("://")
    if not sep or scheme not in _BACKENDS:
        raise ConfigError(
            f"unknown transport address {address!r}; expected one of "
            + ", ".join(f"{s}://..." for s in sorted(_BACKENDS))
        )
    return importlib.import_module(_BACKENDS[scheme])


def connect(address: str, **options) -> FFNClient:
    return _backend(address).connect(address, **options)


def listen(address: str, serving: FFNServing, **options) -> Listener:
    return _backend(address).listen(address, serving, **options)


__all__ = ["connect", "listen"]
