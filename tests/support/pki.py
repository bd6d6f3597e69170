"""A throw-away certificate authority for TLS tests, made with the ``openssl`` command:
a CA, a server certificate for 127.0.0.1 and client certificates named by their CN."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca(self) -> str:
        return str(self.directory / "ca.pem")

    @property
    def server(self) -> tuple[str, str]:
        return self.cert("server")

    def cert(self, name: str) -> tuple[str, str]:
        """(certificate, key) files of ``name``."""
        return str(self.directory / f"{name}.pem"), str(self.directory / f"{name}.key")

    def issue(self, name: str, common_name: str, *extensions: str) -> tuple[str, str]:
        cert, key = self.cert(name)
        csr = str(self.directory / f"{name}.csr")
        _openssl("req", *_KEY, "-subj", f"/CN={common_name}", "-keyout", key, "-out", csr)
        ext = self.directory / f"{name}.ext"
        ext.write_text("\n".join(extensions) + "\n")
        ca_key = str(self.directory / "ca.key")
        _openssl(
            "x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", ca_key, "-CAcreateserial",
            "-days", "1", "-out", cert, "-extfile", str(ext),
        )  # fmt: skip
        return cert, key

    def client_context(self, name: str | None = None) -> ssl.SSLContext:
        """A client's context trusting the CA, presenting ``name``'s certificate if given."""
        context = ssl.create_default_context(cafile=self.ca)
        if name is not None:
            context.load_cert_chain(*self.cert(name))
        return context


def make_pki(directory: Path, clients: tuple[str, ...] = ()) -> Pki:
    """A CA, a server certificate (CN and SAN 127.0.0.1) and one client certificate per
    name in ``clients`` (CN = the name)."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    _openssl(
        "req", "-x509", *_KEY, "-days", "1", "-subj", "/CN=keygate test CA",
        "-keyout", str(directory / "ca.key"), "-out", pki.ca,
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    pki.issue(
        "server", "127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        "extendedKeyUsage=serverAuth",
    )  # fmt: skip
    for name in clients:
        pki.issue(name, name, "extendedKeyUsage=clientAuth")
    return pki


__all__ = ["Pki", "make_pki"]
