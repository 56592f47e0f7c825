"""Make a private CA and one certificate per service, for the TLS stack (``make up-tls``) and local trials.

    python scripts/make_certs.py --out certs --service router --service recorder --service worker-v1

writes ``ca.pem`` (and ``ca-key.pem``), and for each service ``NAME.pem`` / ``NAME-key.pem``, a
certificate for the names ``NAME``, ``localhost`` and ``127.0.0.1`` usable as a server's and as a
client's (the router presents its own to the recorder for mutual TLS). Files that exist are kept,
so a container that runs this at every start does not rotate certificates behind running services;
``--force`` makes everything anew (rotation: services re-read their files without a restart).

Needs ``cryptography``. For trials only: a production deployment has its own CA and renewal.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """Written beside and renamed into place: a service re-reading its files never sees half of one."""
    staging = path.with_name(f".{path.name}.new")
    staging.write_bytes(data)
    staging.chmod(mode)
    os.replace(staging, path)


def _ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = out / "ca.pem", out / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitstream trial CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_bytes(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _leaf(
    out: Path, service: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, days: int, key_mode: int
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [
        x509.DNSName(service),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, service)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    # Key first: a server that re-reads between the two renames sees a mismatched pair, refuses it and
    # keeps serving the old one; it picks up the new pair at its next handshake.
    _write(out / f"{service}-key.pem", _key_bytes(key), key_mode)
    _write(out / f"{service}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="directory for the PEM files")
    parser.add_argument("--service", action="append", default=[], help="a service name (repeat)")
    parser.add_argument("--days", type=int, default=30, help="validity of the certificates")
    parser.add_argument("--force", action="store_true", help="make the service certificates anew (rotation)")
    parser.add_argument(
        "--shared-keys",
        action="store_true",
        help="private keys readable by every user (0644): containers whose services run as different users "
        "share one volume of trial certificates; never for real keys",
    )
    args = parser.parse_args(argv)
    if not args.service:
        parser.error("give at least one --service")
    args.out.mkdir(parents=True, exist_ok=True)
    key_mode = 0o644 if args.shared_keys else 0o600
    ca, ca_key = _ca(args.out, args.days * 4)
    for service in args.service:
        if args.force or not (args.out / f"{service}.pem").exists() or not (args.out / f"{service}-key.pem").exists():
            _leaf(args.out, service, ca, ca_key, args.days, key_mode)
    print(f"certificates for {', '.join(args.service)} in {args.out} (CA: {args.out / 'ca.pem'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
