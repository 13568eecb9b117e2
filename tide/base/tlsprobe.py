"""Why a TLS link cannot work, as one line, where gRPC only says UNAVAILABLE.

gRPC reports a plaintext client dialling a TLS server as "Socket closed", and a
certificate that does not verify as "failed to connect to all addresses" with the
handshake's error somewhere in the details: the same status as a server that is merely
down. A client that retries those forever sits Running and does nothing (a launcher
without the CA, a CLI through a port-forward whose certificate names the Service).
:func:`diagnose` dials the server once more with Python's own TLS and tells the two
apart: a cause that no retry cures, or None for a server that is down, slow or fine.

Blocking (a socket with a timeout): call it off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import socket
import ssl

from tide.base.client import channel_target
from tide.base.credentials import ClientCredentials

#: How long each probe's connect and handshake may take, seconds.
PROBE_TIMEOUT_S = 2.0


def _first_address(target: str) -> tuple[str, int]:
    """HOST and PORT of ``target`` (the first replica of an address list)."""
    resolved, _ = channel_target(target)
    first = resolved.split(":", 1)[1].split(",")[0] if resolved.startswith("ipv") else resolved
    host, _, port = first.rpartition(":")
    return host.strip("[]"), int(port)


def _connect(host: str, port: int, timeout_s: float) -> socket.socket | None:
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return None  # refused, unroutable, not resolved: the network's, retried


def _handshake(sock: socket.socket, ctx: ssl.SSLContext, server_name: str | None) -> ssl.SSLSocket:
    ctx.set_alpn_protocols(["h2"])
    return ctx.wrap_socket(sock, server_hostname=server_name)


def _speaks_tls(host: str, port: int, timeout_s: float) -> bool | None:
    """Whether the server completes a TLS handshake (None: could not connect)."""
    sock = _connect(host, port, timeout_s)
    if sock is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with _handshake(sock, ctx, None):
            return True
    except ssl.SSLError as exc:
        # An alert is a TLS server refusing us (no client certificate under TLS 1.2).
        return "ALERT" in (exc.reason or "").upper()
    except OSError:
        return False
    finally:
        sock.close()


def diagnose(
    target: str,
    credentials: ClientCredentials,
    *,
    server_name: str = "",
    timeout_s: float = PROBE_TIMEOUT_S,
) -> str | None:
    """One line naming why TLS to ``target`` with ``credentials`` cannot work (no CA
    for a TLS server, a CA for a plaintext one, a certificate that does not verify or
    names another host, a client certificate the server refuses), or None when the
    cause is not TLS: the server is unreachable (retry) or the handshake works."""
    host, port = _first_address(target)
    if not credentials.tls:
        if _speaks_tls(host, port, timeout_s):
            return (
                f"{target} speaks TLS and no CA is configured to verify it: pass"
                " --tls-ca-file or set TIDE_TLS_CA_FILE (docs/security.md)"
            )
        return None
    sock = _connect(host, port, timeout_s)
    if sock is None:
        return None
    ctx = ssl.create_default_context(cafile=credentials.tls_ca_file)
    if credentials.tls_client_cert_file:
        ctx.load_cert_chain(credentials.tls_client_cert_file, credentials.tls_client_key_file)
    name = server_name or host
    try:
        with _handshake(sock, ctx, name) as tls:
            # Under TLS 1.3 the server judges the client's certificate after the client
            # finished: its refusal arrives as an alert on the first read.
            tls.settimeout(min(timeout_s, 0.5))
            try:
                closed = tls.recv(1) == b""
            except TimeoutError:
                closed = False  # waiting for our HTTP/2 preface: the handshake stands
            if closed:
                return _refused_client(target, credentials)
    except ssl.SSLCertVerificationError as exc:
        hint = (
            " (the certificate names other hosts: pass --tls-server-name or set"
            " TIDE_TLS_SERVER_NAME to a name it holds)"
            if "hostname" in (exc.verify_message or "").lower()
            or "ip address" in (exc.verify_message or "").lower()
            else ""
        )
        return (
            f"the certificate of {target} does not verify against"
            f" {credentials.tls_ca_file} for {name!r}: {exc.verify_message}{hint}"
        )
    except ssl.SSLEOFError:
        return _closed_on_hello(target, host, port, timeout_s)
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "ALERT" in reason.upper():
            return f"{_refused_client(target, credentials)} ({reason})"
        if "WRONG_VERSION" in reason.upper() or "RECORD_LAYER" in reason.upper():
            return f"{target} does not speak TLS ({reason}): drop --tls-ca-file"
        return None
    except OSError:
        return _closed_on_hello(target, host, port, timeout_s)
    finally:
        sock.close()
    return None


def _refused_client(target: str, credentials: ClientCredentials) -> str:
    if credentials.tls_client_cert_file:
        return f"{target} refused this client's TLS certificate"
    return (
        f"{target} requires a client certificate (mTLS): pass --tls-client-cert-file"
        " and --tls-client-key-file"
    )


def _closed_on_hello(target: str, host: str, port: int, timeout_s: float) -> str | None:
    # A server that closes a TLS ClientHello at once speaks plaintext (gRPC's own
    # server does so when it expects the HTTP/2 preface); a reset may also be a
    # restart, so ask the plain question once more.
    if _speaks_tls(host, port, timeout_s) is False:
        return f"{target} does not speak TLS: drop --tls-ca-file or TIDE_TLS_CA_FILE"
    return None
