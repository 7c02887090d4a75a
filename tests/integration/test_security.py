"""Inter-service authentication on the data plane, and no pickle anywhere near a socket.

CURVE: a client holding the authorized keypair is served; a plaintext client or one with an
unknown key gets nothing (its wait() times out). gRPC mTLS: a client with a certificate signed
by the CA is served; one without a client certificate, or in plaintext, is refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import pickle
import re
import time
from pathlib import Path

import pytest
import torch

from afd.errors import TransportError
from afd.messages import FFNRequest
from afd.security import Security, write_curve_keys
from afd.transport import FFNServing, connect, listen
from afd.wire import WireLimits
from afd_cli.procs import free_port

REPO = Path(__file__).resolve().parents[2]
LIMITS = WireLimits(hidden_size=16, num_layers=2, num_experts=4, max_tokens=8, top_k=2)


def _compute(layer: int, reqs: list[FFNRequest]) -> list[torch.Tensor]:
    return [r.hidden.to(torch.bfloat16) * 2 for r in reqs]


def _serving() -> FFNServing:
    return FFNServing(_compute, LIMITS)


def _req(seq: int) -> FFNRequest:
    return FFNRequest(
        layer=0,
        micro_batch=0,
        seq=seq,
        hidden=torch.ones(3, 16, dtype=torch.bfloat16),
        scales=None,
        expert_ids=torch.zeros(3, 2, dtype=torch.int32),
        expert_weights=torch.full((3, 2), 0.5),
        deadline=time.time() + 5,
    )


def _served(client, seq: int, timeout: float = 3.0) -> bool:
    client.send(_req(seq))
    try:
        reply = client.wait(seq, timeout)
    except TransportError:
        return False
    return reply.ok and torch.equal(reply.output, torch.full((3, 16), 2.0, dtype=torch.bfloat16))


def test_curve_admits_only_the_authorized_key(tmp_path):
    keys = write_curve_keys(tmp_path / "keys")
    other = write_curve_keys(tmp_path / "other")  # a valid keypair the server never authorized
    addr = f"tcp://127.0.0.1:{free_port()}"
    srv = listen(addr, _serving(), security=Security(curve_dir=str(keys)))
    clients = []
    try:
        good = connect(addr, security=Security(curve_dir=str(keys)))
        clients.append(good)
        assert _served(good, 0)
        plain = connect(addr)
        clients.append(plain)
        assert not _served(plain, 0, timeout=1.5)
        # Knows the server's public key but presents an unauthorized client key.
        (other / "server.key").write_bytes((keys / "server.key").read_bytes())
        intruder = connect(addr, security=Security(curve_dir=str(other)))
        clients.append(intruder)
        assert not _served(intruder, 0, timeout=1.5)
        assert _served(good, 1)  # still serving the authorized peer
    finally:
        for c in clients:
            c.close()
        srv.close()


def _write_pki(d: Path) -> dict[str, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(name, key, issuer_cert, issuer_key, ca=False):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(
                issuer_cert.subject
                if issuer_cert
                else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
            )
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return b.sign(issuer_key or key, hashes.SHA256())

    pem = serialization.Encoding.PEM
    out = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("afd-test-ca", ca_key, None, None, ca=True)
    out["ca"] = d / "ca.pem"
    out["ca"].write_bytes(ca.public_bytes(pem))
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[f"{who}_cert"] = d / f"{who}.pem"
        out[f"{who}_cert"].write_bytes(cert(who, key, ca, ca_key).public_bytes(pem))
        out[f"{who}_key"] = d / f"{who}-key.pem"
        out[f"{who}_key"].write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
    return out


def test_grpc_mutual_tls(tmp_path):
    pki = _write_pki(tmp_path)
    addr = f"grpc://127.0.0.1:{free_port()}"
    server_sec = Security(
        tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]), tls_ca=str(pki["ca"])
    )
    srv = listen(addr, _serving(), security=server_sec)
    clients = []
    try:
        good = connect(
            addr,
            security=Security(
                tls_cert=str(pki["client_cert"]),
                tls_key=str(pki["client_key"]),
                tls_ca=str(pki["ca"]),
            ),
        )
        clients.append(good)
        assert _served(good, 0)
        no_client_cert = connect(addr, security=Security(tls_ca=str(pki["ca"])))
        clients.append(no_client_cert)
        assert not _served(no_client_cert, 0, timeout=2)
        plain = connect(addr)
        clients.append(plain)
        assert not _served(plain, 0, timeout=2)
        assert _served(good, 1)
    finally:
        for c in clients:
            c.close()
        srv.close()


# --- no pickle -----------------------------------------------------------------------------

FORBIDDEN = re.compile(
    r"\bimport (c?pickle|marshal|dill|cloudpickle)\b|\bfrom (c?pickle|marshal|dill|cloudpickle) "
    r"import|\b(pickle|marshal|cloudpickle)\.loads?\(|\btorch\.load\(|(?<![\w.])eval\(|(?<![\w.])exec\("
)


def test_no_pickle_marshal_or_eval_in_the_code():
    offenders = []
    for root in ("afd", "services"):
        for f in (REPO / root).rglob("*.py"):
            if f.name.endswith("_pb2.py") or f.name.endswith("_pb2_grpc.py"):
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if FORBIDDEN.search(line.split("#", 1)[0]):
                    offenders.append(f"{f.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/afd-pickle-was-executed"),))


@pytest.mark.parametrize("scheme", ["tcp", "grpc"])
def test_hostile_pickle_frames_are_rejected_and_never_run(scheme):
    marker = Path("/tmp/afd-pickle-was-executed")
    marker.unlink(missing_ok=True)
    addr = f"{scheme}://127.0.0.1:{free_port()}"
    srv = listen(addr, _serving())
    client = connect(addr)
    try:
        payload = pickle.dumps(_Boom())
        for frames in (
            [payload],
            [payload, payload, payload, payload, payload],
            [b"\x80\x04" * 50],
        ):
            client.send_frames(frames)
        time.sleep(0.5)
        assert _served(client, 7)  # the server kept serving valid traffic
        assert not marker.exists()
    finally:
        client.close()
        srv.close()


def test_gateway_reaches_attention_servers_over_tls(tmp_path):
    """The gateway's control-plane client: TLS (with a client certificate) against an
    attention server's mTLS port; plaintext, or TLS without a client certificate, is refused."""
    import asyncio

    import grpc

    from afd.control import pb, pb_grpc
    from afd.security import add_port
    from services.gateway.client import AttentionClient
    from services.gateway.errors import APIError

    class Servicer(pb_grpc.AttentionServiceServicer):
        async def Health(self, request, context):  # noqa: N802 - gRPC's method name
            return pb.HealthReply(live=True, ready=True, model="m", max_model_len=64)

    pki = _write_pki(tmp_path)
    server_sec = Security(
        tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]), tls_ca=str(pki["ca"])
    )
    client_sec = Security(
        tls_cert=str(pki["client_cert"]), tls_key=str(pki["client_key"]), tls_ca=str(pki["ca"])
    )

    async def go():
        server = grpc.aio.server()
        pb_grpc.add_AttentionServiceServicer_to_server(Servicer(), server)
        addr = f"127.0.0.1:{free_port()}"
        assert add_port(server, addr, server_sec)
        await server.start()
        results = []
        try:
            for sec in (client_sec, None, Security(tls_ca=str(pki["ca"]))):
                client = AttentionClient(addr, rpc_timeout_s=2.0, security=sec)
                try:
                    results.append((await client.health()).ready)
                except APIError as e:
                    results.append(e.status)
                await client.close()
        finally:
            await server.stop(None)
        return results

    assert asyncio.run(go()) == [True, 503, 503]
