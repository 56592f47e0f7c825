"""The names a verified client certificate carries, each read by its type from the certificate itself.

gRPC's auth context lists every subject alternative name under one property,
``x509_subject_alternative_name``, whatever its type: an email (rfc822Name) or a URI SAN spelled
``router-a.example`` would be indistinguishable from the DNS name ``router-a.example``, and whoever
a CA issued such a certificate to would pass an allow-list of host names. So the identities are read
from the peer's certificate (``x509_pem_cert``), by type:

- the subject's common name (CN);
- DNS SANs (dNSName);
- SPIFFE IDs: URI SANs whose scheme is ``spiffe`` (``spiffe://trust-domain/path``), compared whole.

Other SAN types (emails, IP addresses, other URIs, directory names) are never identities. Without a
certificate in the auth context (no mutual TLS) there are none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from cryptography import x509
from cryptography.x509.oid import NameOID

#: The auth-context property gRPC fills with the verified peer's leaf certificate (PEM).
PEM_CERT_PROPERTY = "x509_pem_cert"
SPIFFE_PREFIX = "spiffe://"


def certificate_identities(pem: bytes) -> frozenset[str]:
    """The CN, DNS SANs and SPIFFE URI SANs of the PEM certificate ``pem`` (empty if it does not parse)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return frozenset()
    names = {
        value
        for attribute in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if isinstance(value := attribute.value, str)
    }
    try:
        alternative = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        return frozenset(names)
    names.update(alternative.get_values_for_type(x509.DNSName))
    names.update(
        uri
        for uri in alternative.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.lower().startswith(SPIFFE_PREFIX)
    )
    return frozenset(names)


def peer_identities(auth_context: Mapping[str, Iterable[bytes]]) -> frozenset[str]:
    """The identities of the certificate gRPC verified for this call (empty without mutual TLS)."""
    names: set[str] = set()
    for pem in auth_context.get(PEM_CERT_PROPERTY, ()):
        names |= certificate_identities(pem)
    return frozenset(names)
