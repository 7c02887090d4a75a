"""Inter-service authentication: ZeroMQ CURVE for tcp/ipc, TLS (optionally mutual) for gRPC.

Keys and certificates come from files named on the command line or, when a flag is absent,
from the environment (AFD_CURVE_DIR, AFD_TLS_CERT, AFD_TLS_KEY, AFD_TLS_CA), so a Kubernetes
Secret can be mounted or injected without changing the command.

CURVE directory layout (`afd keys --out DIR` writes it):
  server.key, server.key_secret    the FFN servers' keypair (ZeroMQ certificate files)
  client.key, client.key_secret    the attention servers' keypair
  authorized/                      public keys of the clients an FFN server accepts
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from afd.errors import ConfigError


@dataclass(frozen=True)
class Security:
    curve_dir: str = ""
    tls_cert: str = ""  # PEM certificate chain of this side
    tls_key: str = ""  # PEM private key of this side
    tls_ca: str = ""  # PEM CA bundle: verify the peer; on a server it also demands client certs

    @property
    def curve(self) -> bool:
        return bool(self.curve_dir)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    def with_env(self) -> Security:
        """Fill the fields left empty from AFD_* environment variables."""
        env = os.environ
        return Security(
            curve_dir=self.curve_dir or env.get("AFD_CURVE_DIR", ""),
            tls_cert=self.tls_cert or env.get("AFD_TLS_CERT", ""),
            tls_key=self.tls_key or env.get("AFD_TLS_KEY", ""),
            tls_ca=self.tls_ca or env.get("AFD_TLS_CA", ""),
        )

    def read(self, name: str) -> bytes:
        path = getattr(self, name)
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read {name.replace('_', ' ')} file {path!r}: {e}") from e

    def curve_keys(self, who: str) -> tuple[bytes, bytes]:
        """(public, secret) z85 keys of 'server' or 'client' from the CURVE directory."""
        import zmq.auth

        f = Path(self.curve_dir) / f"{who}.key_secret"
        if not f.is_file():
            raise ConfigError(f"CURVE key {f} is missing; create the directory with `afd keys`")
        public, secret = zmq.auth.load_certificate(str(f))
        if not secret:
            raise ConfigError(f"{f} holds no secret key")
        return public, secret

    def server_public_key(self) -> bytes:
        import zmq.auth

        f = Path(self.curve_dir) / "server.key"
        if not f.is_file():
            raise ConfigError(f"CURVE server public key {f} is missing")
        return zmq.auth.load_certificate(str(f))[0]

    @property
    def authorized_dir(self) -> str:
        return str(Path(self.curve_dir) / "authorized")


def write_curve_keys(out_dir: str | Path) -> Path:
    """Create a CURVE directory: server and client keypairs, the client authorized."""
    import zmq.auth

    out = Path(out_dir)
    (out / "authorized").mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(out), "server")
    client_public, _ = zmq.auth.create_certificates(str(out), "client")
    shutil.copy(client_public, out / "authorized" / "client.key")
    for secret in out.glob("*.key_secret"):
        secret.chmod(0o600)
    return out


def server_credentials(security: Security):
    """TLS for a gRPC server; with a CA given, clients must present a certificate (mTLS)."""
    import grpc

    if not (security.tls_cert and security.tls_key):
        raise ConfigError("a TLS server needs both --tls-cert and --tls-key")
    ca = security.read("tls_ca") if security.tls_ca else None
    return grpc.ssl_server_credentials(
        [(security.read("tls_key"), security.read("tls_cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def channel_credentials(security: Security):
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=security.read("tls_ca") if security.tls_ca else None,
        private_key=security.read("tls_key") if security.tls_key else None,
        certificate_chain=security.read("tls_cert") if security.tls_cert else None,
    )


# gRPC's own reconnect backoff starts at 1 s and grows to 2 minutes while a peer is down, so a
# server back after a long outage (a restart, a rescheduled pod) went unseen for up to that
# long; every channel afd opens retries within a second instead.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def _with_reconnect(options: list) -> list:
    """`options` with RECONNECT_OPTIONS for the keys it does not set itself."""
    given = {key for key, _ in options}
    return [*options, *(o for o in RECONNECT_OPTIONS if o[0] not in given)]


def channel(target: str, options: list, security: Security | None):
    """A gRPC channel: TLS when configured, plaintext otherwise; reconnecting promptly."""
    import grpc

    options = _with_reconnect(options)
    if security is not None and security.tls:
        return grpc.secure_channel(target, channel_credentials(security), options=options)
    return grpc.insecure_channel(target, options=options)


def aio_channel(target: str, options: list, security: Security | None):
    """An asyncio gRPC channel (the gateway's): TLS when configured, plaintext otherwise;
    reconnecting promptly."""
    import grpc

    options = _with_reconnect(options)
    if security is not None and security.tls:
        return grpc.aio.secure_channel(target, channel_credentials(security), options=options)
    return grpc.aio.insecure_channel(target, options=options)


def add_port(server, target: str, security: Security | None) -> int:
    if security is not None and security.tls:
        return server.add_secure_port(target, server_credentials(security))
    return server.add_insecure_port(target)
