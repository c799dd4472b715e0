"""Test certificates: one CA and certificates it signs, for 127.0.0.1, serving and as clients."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest


def make_pki(
    names: dict[str, tuple[str, list[str]]], ca_name: str = "paramshard test CA"
) -> dict[str, bytes]:
    """A CA (``"ca"``, named ``ca_name``) and, for each ``{label: (common name, DNS alternative
    names)}``, a certificate ``label`` and its key ``label + "_key"`` (PEM), valid for IP
    127.0.0.1 as a server and as a client. Skips the test without the ``cryptography``
    package."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(cn: str):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())

    def build(subject: str, public: object):
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(ca_name))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    pem = serialization.Encoding.PEM
    ca = (
        build(ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    out = {"ca": ca.public_bytes(pem)}
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    for label, (common_name, dns) in names.items():
        key = ec.generate_private_key(ec.SECP256R1())
        alt = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), *map(x509.DNSName, dns)]
        cert = (
            build(common_name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        out[label] = cert.public_bytes(pem)
        out[f"{label}_key"] = key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    return out


@dataclass
class Pki:
    """tests/test_security.py's certificates: a CA signing a server certificate (127.0.0.1,
    localhost) and a client's, and an impostor's CA signing a client certificate."""

    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes
    other_ca: bytes
    other_client_cert: bytes
    other_client_key: bytes


def security_pki() -> Pki:
    ours = make_pki({"server": ("shard server", ["localhost"]), "client": ("trainer", [])})
    other = make_pki({"client": ("impostor", [])}, ca_name="impostor CA")
    return Pki(
        ca=ours["ca"],
        server_cert=ours["server"],
        server_key=ours["server_key"],
        client_cert=ours["client"],
        client_key=ours["client_key"],
        other_ca=other["ca"],
        other_client_cert=other["client"],
        other_client_key=other["client_key"],
    )


def write_server_files(pki: Pki, folder: Path) -> dict[str, Path]:
    """``pki``'s CA, server certificate and key as files only their owner reads."""
    out = {}
    for name, data in {"ca": pki.ca, "cert": pki.server_cert, "key": pki.server_key}.items():
        path = folder / f"{name}.pem"
        path.write_bytes(data)
        path.chmod(0o600)
        out[name] = path
    return out
