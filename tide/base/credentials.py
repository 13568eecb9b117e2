"""What a Tide client presents: one naming scheme for every client (agent, launcher,
scaler → coordinator, CLI).

| setting | flag | env |
| --- | --- | --- |
| CA that signed the server | ``--tls-ca-file`` | TIDE_TLS_CA_FILE |
| client certificate (mTLS) | ``--tls-client-cert-file`` | TIDE_TLS_CLIENT_CERT_FILE |
| client key (mTLS) | ``--tls-client-key-file`` | TIDE_TLS_CLIENT_KEY_FILE |
| bearer token, from a file | ``--token-file`` | TIDE_TOKEN_FILE |

The token is read from its file, and read again whenever the file changes, so a
rotated Kubernetes Secret or a refreshed projected ServiceAccount token is picked up
without a restart. A token is never part of a ``repr``, a log line or an error.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tide.base.errors import ConfigError

#: Env names of the client credentials, one place for every client.
ENV_TLS_CA_FILE = "TIDE_TLS_CA_FILE"
ENV_TLS_CLIENT_CERT_FILE = "TIDE_TLS_CLIENT_CERT_FILE"
ENV_TLS_CLIENT_KEY_FILE = "TIDE_TLS_CLIENT_KEY_FILE"
ENV_TOKEN_FILE = "TIDE_TOKEN_FILE"
CLIENT_ENV = (ENV_TLS_CA_FILE, ENV_TLS_CLIENT_CERT_FILE, ENV_TLS_CLIENT_KEY_FILE, ENV_TOKEN_FILE)


class CredentialFields(Protocol):
    """Whatever names the four files with the fields of these names: a settings class,
    a CLI's options."""

    @property
    def tls_ca_file(self) -> str: ...
    @property
    def tls_client_cert_file(self) -> str: ...
    @property
    def tls_client_key_file(self) -> str: ...
    @property
    def token_file(self) -> str: ...


@dataclass(frozen=True)
class ClientCredentials:
    """A client's CA, certificate, key and token file; all optional (empty: none)."""

    tls_ca_file: str = ""
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""
    token_file: str = ""
    _token: TokenFile | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if bool(self.tls_client_cert_file) != bool(self.tls_client_key_file):
            raise ConfigError("tls_client_cert_file and tls_client_key_file must be given together")
        if self.tls_client_cert_file and not self.tls_ca_file:
            raise ConfigError("tls_client_cert_file (mTLS) needs tls_ca_file to verify the server")
        for name in ("tls_ca_file", "tls_client_cert_file", "tls_client_key_file", "token_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path!r}")
        if self.token_file:
            object.__setattr__(self, "_token", TokenFile(self.token_file))

    @classmethod
    def of(cls, source: CredentialFields) -> ClientCredentials:
        """The credentials ``source`` names, field for field."""
        return cls(
            tls_ca_file=source.tls_ca_file,
            tls_client_cert_file=source.tls_client_cert_file,
            tls_client_key_file=source.tls_client_key_file,
            token_file=source.token_file,
        )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ClientCredentials:
        e = dict(os.environ) if env is None else env
        return cls(
            tls_ca_file=e.get(ENV_TLS_CA_FILE, ""),
            tls_client_cert_file=e.get(ENV_TLS_CLIENT_CERT_FILE, ""),
            tls_client_key_file=e.get(ENV_TLS_CLIENT_KEY_FILE, ""),
            token_file=e.get(ENV_TOKEN_FILE, ""),
        )

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file)

    @property
    def any(self) -> bool:
        return bool(self.tls_ca_file or self.token_file)

    def token(self) -> str:
        """The token now in the file ("" without one)."""
        return self._token.read() if self._token is not None else ""

    def env(self) -> dict[str, str]:
        """The same credentials as TIDE_* variables, for a child process."""
        return {
            k: v
            for k, v in (
                (ENV_TLS_CA_FILE, self.tls_ca_file),
                (ENV_TLS_CLIENT_CERT_FILE, self.tls_client_cert_file),
                (ENV_TLS_CLIENT_KEY_FILE, self.tls_client_key_file),
                (ENV_TOKEN_FILE, self.token_file),
            )
            if v
        }


NO_CREDENTIALS = ClientCredentials()


class WatchedFile:
    """A file's text, read again when its mtime, size or inode changes (a Secret's
    atomic symlink swap changes the inode; a projected token's refresh the mtime); the
    last text is kept while the file cannot be read (a Secret being swapped)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] | None = None
        self._value = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r})"

    def read(self) -> str:
        try:
            st = os.stat(self._path)
        except OSError:
            return self._value
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key != self._key:
                try:
                    self._value = self._parse(Path(self._path).read_text())
                    self._key = key
                except OSError:
                    pass
            return self._value

    def _parse(self, text: str) -> str:
        return text


class TokenFile(WatchedFile):
    """A bearer token's file: its text less surrounding whitespace."""

    def _parse(self, text: str) -> str:
        return text.strip()
