"""A small certificate authority for local mode and tests (the ``cryptography`` library).

`tide up` and `tide demo` make one under ``STATE_DIR/pki`` at start, so every link
runs mTLS every day: one server certificate for 127.0.0.1/localhost that the
scaler and the coordinator share, and one client certificate per identity with
its SPIFFE ID in the SAN (tide.services.common.guard). The local actuator issues each
launcher's certificate (its pod of its job) as it starts the pod. In a cluster,
cert-manager does this job (docs/security.md).

Keys are ECDSA P-256 (fast to make, small), written with mode 0600.
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

from tide.base.credentials import ClientCredentials
from tide.services.common.files import write_atomic
from tide.services.common.guard import spiffe_id

#: Local mode's namespace and ServiceAccount in the identities it issues.
LOCAL_NS = "local"
LOCAL_SA = "tide"


@dataclass(frozen=True)
class Issued:
    cert_file: str
    key_file: str


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class CertificateAuthority:
    """A CA whose certificate and key are files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.ca_file = str(self.dir / "ca.pem")
        key_pem = (self.dir / "ca-key.pem").read_bytes()
        key = serialization.load_pem_private_key(key_pem, None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._key = key
        self._cert = x509.load_pem_x509_certificate((self.dir / "ca.pem").read_bytes())

    @classmethod
    def create(cls, directory: Path, *, name: str = "Tide local CA") -> CertificateAuthority:
        directory = Path(directory)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
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
            .sign(key, hashes.SHA256())
        )
        write_atomic(directory / "ca-key.pem", _key_pem(key), private=True)
        write_atomic(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
        return cls(directory)

    @classmethod
    def load_or_create(cls, directory: Path) -> CertificateAuthority:
        if (Path(directory) / "ca-key.pem").is_file() and (Path(directory) / "ca.pem").is_file():
            return cls(directory)
        return cls.create(directory)

    def issue(
        self,
        name: str,
        *,
        uris: tuple[str, ...] = (),
        hosts: tuple[str, ...] = (),
        server: bool = False,
        valid_days: float = 30.0,
        not_before: datetime.datetime | None = None,
    ) -> Issued:
        """Write ``name.pem`` and ``name-key.pem``: a certificate with these URI SANs
        (identities) and host SANs (DNS names or IP addresses, for a server)."""
        key = ec.generate_private_key(ec.SECP256R1())
        start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        usage.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=valid_days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        cert_path = self.dir / f"{safe}.pem"
        key_path = self.dir / f"{safe}-key.pem"
        write_atomic(key_path, _key_pem(key), private=True)
        write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return Issued(str(cert_path), str(key_path))

    # --- Tide's identities ---

    def server(self, name: str = "server") -> Issued:
        return self.issue(name, hosts=("127.0.0.1", "localhost", "::1"), server=True)

    def agent(self, node: str) -> Issued:
        return self.issue(f"agent-{node}", uris=(spiffe_id(LOCAL_NS, LOCAL_SA, "node", node),))

    def launcher(self, job_id: str, pod: str, *, directory: Path | None = None) -> Issued:
        ns, _, name = job_id.partition("/")
        uri = spiffe_id(ns, LOCAL_SA, "job", name, "pod", pod)
        if directory is None:
            return self.issue(f"launcher-{pod}", uris=(uri,))
        # Into the pod's own directory: what a pod sees is its certificate only.
        sub = CertificateAuthority.__new__(CertificateAuthority)
        sub.__dict__.update(self.__dict__)
        sub.dir = Path(directory)
        return sub.issue("launcher", uris=(uri,))

    def credentials(self, issued: Issued, token_file: str = "") -> ClientCredentials:
        """What a client holding ``issued`` presents to a server this CA signed."""
        return ClientCredentials(
            tls_ca_file=self.ca_file,
            tls_client_cert_file=issued.cert_file,
            tls_client_key_file=issued.key_file,
            token_file=token_file,
        )

    def scaler(self) -> Issued:
        return self.issue("scaler", uris=(spiffe_id(LOCAL_NS, LOCAL_SA, "scaler"),))

    def user(self, name: str, role: str) -> Issued:
        return self.issue(
            f"user-{name}-{role}", uris=(spiffe_id(LOCAL_NS, LOCAL_SA, "user", name, "role", role),)
        )
