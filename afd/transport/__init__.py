"""The data plane's pluggable transport: `connect` on the attention side, `listen` on the FFN
side, one backend module per address scheme (registry.py)."""

from afd.transport.base import FFNClient, Listener
from afd.transport.registry import connect, listen
from afd.transport.serving import FFNServing

__all__ = ["FFNClient", "FFNServing", "Listener", "connect", "listen"]
