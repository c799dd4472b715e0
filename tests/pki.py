"""Test certificates: one CA and certificates it signs, for 127.0.0.1, serving and as clients."""

from __future__ import annotations

import datetime
import ipaddress

import pytest


def make_pki(names: dict[str, tuple[str, list[str]]]) -> dict[str, bytes]:
    """A CA (``"ca"``) and, for each ``{label: (common name, DNS alternative names)}``, a
    certificate ``label`` and its key ``label + "_key"`` (PEM), valid for IP 127.0.0.1 as a
    server and as a client. Skips the test without the ``cryptography`` package."""
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
            .issuer_name(name("paramshard test CA"))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    pem = serialization.Encoding.PEM
    ca = (
        build("paramshard test CA", ca_key.public_key())
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
