"""A throwaway PKI for the mTLS tests: CAs, server and client certificates, CRLs, made with
``cryptography`` and written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

_NOW = datetime.datetime.now(datetime.UTC)
_DAY = datetime.timedelta(days=1)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Authority:
    """A CA that issues certificates into ``directory``."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = Path(directory)
        self.name = name
        self.key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.certificate = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(self.key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(_NOW - _DAY).not_valid_after(_NOW + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.ca_file = str(self.directory / f"{name}-ca.crt")
        Path(self.ca_file).write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        self.revoked: list[x509.Certificate] = []

    def issue(self, name: str, *, cn: str | None = None, uris: tuple[str, ...] = (), dns: tuple[str, ...] = (),
              ips: tuple[str, ...] = (), expired: bool = False, server: bool = False) -> tuple[str, str]:
        """A leaf certificate and its key, as (cert_file, key_file)."""
        key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn or name)])
        not_after = _NOW - _DAY if expired else _NOW + 7 * _DAY
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(self.certificate.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(_NOW - 2 * _DAY).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH if server
                                                  else x509.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
        names += [x509.DNSName(name) for name in dns]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        cert_file, key_file = self.directory / f"{name}.crt", self.directory / f"{name}.key"
        cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(_key_pem(key))
        self._issued = getattr(self, "_issued", {})
        self._issued[str(cert_file)] = certificate
        return str(cert_file), str(key_file)

    def revoke(self, cert_file: str) -> None:
        self.revoked.append(self._issued[cert_file])

    def write_crl(self, path: str | Path) -> str:
        """A CRL listing every certificate revoked so far, valid for a week."""
        builder = (x509.CertificateRevocationListBuilder().issuer_name(self.certificate.subject)
                   .last_update(_NOW - _DAY).next_update(_NOW + 7 * _DAY))
        for certificate in self.revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(certificate.serial_number)
                .revocation_date(_NOW - _DAY).build())
        crl = builder.sign(self.key, hashes.SHA256())
        Path(path).write_bytes(crl.public_bytes(serialization.Encoding.PEM))
        return str(path)
