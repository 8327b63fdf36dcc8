"""Throwaway X.509 material for mutual-TLS tests, made with the ``cryptography`` package.

- ``make_ca(dir)``: a self-signed CA, ``dir/ca.pem`` and ``dir/ca.key``;
- ``make_node_cert(ca_dir, out_dir, name, ips, dns)``: a node certificate signed by that CA,
  ``out_dir/NAME.pem`` and ``out_dir/NAME.key``, usable both as a TLS server and a TLS client
  certificate;
- ``make_self_signed(out_dir, name, ips, dns)``: a certificate no CA signed.

For a "wrong CA" negative test, call ``make_ca`` on a second directory and sign a node
certificate with it. All keys are EC P-256, written unencrypted (PKCS#8 PEM, mode 0600);
certificates are valid from one hour ago for one day.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
BACKDATE = datetime.timedelta(hours=1)
LIFETIME = datetime.timedelta(days=1)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """The key as unencrypted PKCS#8 PEM, readable by its owner only."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _validity() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - BACKDATE, now + LIFETIME


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ckptd tests"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(ips: Sequence[str], dns: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    return x509.SubjectAlternativeName(names)


def _leaf_builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    ips: Sequence[str],
    dns: Sequence[str],
) -> x509.CertificateBuilder:
    """Everything of an end-entity certificate except the authority key id."""
    not_before, not_after = _validity()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(_san(ips, dns), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def make_ca(dir: Path) -> Path:
    """Create a self-signed CA (EC P-256) in ``dir``: ``ca.pem`` and ``ca.key``.

    ``dir`` is created if missing. Each call makes a new, unrelated CA. Returns the path of
    ``ca.pem`` (the root certificate to trust)."""
    dir.mkdir(parents=True, exist_ok=True)
    key = _new_key()
    name = _name(f"ckptd test CA {dir.name}")
    not_before, not_after = _validity()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(dir / CA_KEY, key)
    _write_cert(dir / CA_CERT, cert)
    return dir / CA_CERT


def make_node_cert(
    ca_dir: Path,
    out_dir: Path,
    name: str,
    ips: Sequence[str],
    dns: Sequence[str] = ("localhost",),
) -> tuple[Path, Path]:
    """Issue a certificate for node ``name``, signed by the CA that ``make_ca(ca_dir)`` made.

    EC P-256 key; CN ``name``; SubjectAlternativeName with the IP addresses ``ips`` and the
    DNS names ``dns``; ExtendedKeyUsage serverAuth and clientAuth; valid from now - 1 h for
    1 day. Writes ``out_dir/NAME.pem`` and ``out_dir/NAME.key`` (``out_dir`` is created if
    missing) and returns (certificate path, key path)."""
    ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{ca_dir / CA_KEY} is not an EC private key")
    key = _new_key()
    cert = (
        _leaf_builder(_name(name), ca_cert.subject, key, ips, dns)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _write_pair(out_dir, name, cert, key)


def make_self_signed(
    out_dir: Path,
    name: str,
    ips: Sequence[str],
    dns: Sequence[str] = ("localhost",),
) -> tuple[Path, Path]:
    """A certificate like ``make_node_cert``'s, but signed by its own key (no CA): for
    negative tests. Writes ``out_dir/NAME.pem`` and ``out_dir/NAME.key``; returns both."""
    key = _new_key()
    subject = _name(name)
    cert = _leaf_builder(subject, subject, key, ips, dns).sign(key, hashes.SHA256())
    return _write_pair(out_dir, name, cert, key)


def _write_pair(
    out_dir: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{name}.pem", out_dir / f"{name}.key"
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return cert_path, key_path
