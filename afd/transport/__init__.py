from afd.transport.base import FFNClient, Handler, Listener
from afd.transport.messages import FFNReply, FFNRequest, Trace
from afd.transport.registry import connect, listen, register, schemes

__all__ = [
    "FFNClient",
    "FFNReply",
    "FFNRequest",
    "Handler",
    "Listener",
    "Trace",
    "connect",
    "listen",
    "register",
    "schemes",
]
