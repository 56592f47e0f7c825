"""Certificates made at test time with ``cryptography``: a CA, server and client certificates, an
expired one, one from another CA. Nothing is checked in; every test gets fresh keys.

    pki = Pki(tmp_path)
    server = pki.issue("server", names=("localhost", "127.0.0.1"))
    server.cert, server.key  # PEM file paths
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: What a server certificate names by default: how tests dial (127.0.0.1) and the usual local name.
LOCAL_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    serial: int


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


class Pki:
    """One certificate authority in ``directory`` (``<name>-ca.pem``) and what it issues."""

    def __init__(self, directory: Path, *, name: str = "test") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{name} CA"))
            .issuer_name(_name(f"{name} CA"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.ca = directory / f"{name}-ca.pem"
        self.ca.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        stem: str,
        *,
        names: tuple[str, ...] = LOCAL_NAMES,
        expired: bool = False,
        client: bool = True,
        server: bool = True,
        common_name: str | None = None,
        other_names: tuple[x509.GeneralName, ...] = (),
    ) -> Issued:
        """A leaf certificate for ``names`` (DNS names or IP addresses), usable by servers and clients
        unless told otherwise; ``expired``: its validity ended an hour ago. ``common_name`` (default: the
        first name) is the subject's CN; ``other_names`` are SANs of other types (emails, URIs)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = (
            (now - datetime.timedelta(days=2), now - datetime.timedelta(hours=1))
            if expired
            else (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1))
        )
        alternative: list[x509.GeneralName] = []
        for name in names:
            try:
                alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alternative.append(x509.DNSName(name))
        alternative.extend(other_names)
        usages = [
            *([ExtendedKeyUsageOID.SERVER_AUTH] if server else []),
            *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []),
        ]
        serial = x509.random_serial_number()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name or (names[0] if names else stem)))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        cert_path = self.directory / f"{stem}.pem"
        key_path = self.directory / f"{stem}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return Issued(cert_path, key_path, serial)


def served_serial(host: str, port: int, *, ca: Path, alpn: str = "h2") -> int:
    """The serial number of the certificate the server at ``host:port`` presents to a new connection."""
    import socket
    import ssl

    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    context.set_alpn_protocols([alpn])
    with socket.create_connection((host, port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number
