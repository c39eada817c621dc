"""The metrics listener's web configuration: TLS and basic auth, in the Prometheus exporter-toolkit's file.

canaryd's metrics carry stack facts (engine versions, arguments, fingerprints), so a listener scraped
across the network must speak TLS and ask for credentials. Every Prometheus exporter does that through one
file format (exporter-toolkit's ``--web.config.file``, docs/web-configuration.md in
prometheus/exporter-toolkit), so operators and their tooling already know it; canaryd reads the same file
(``[daemon] web_config``) rather than a format of its own:

.. code-block:: yaml

    tls_server_config:
      cert_file: canaryd.crt            # relative paths: to this file's folder, as exporter-toolkit
      key_file: canaryd.key
      client_auth_type: RequireAndVerifyClientCert   # optional: mutual TLS
      client_ca_file: clients-ca.crt
      min_version: TLS12                # the default, as exporter-toolkit's
    basic_auth_users:
      prometheus: $2b$12$...            # bcrypt hashes (htpasswd -nBC 12 "" | tr -d ':\\n')

A key canaryd does not implement (cipher suites, curve preferences, HTTP/2, custom headers, client SAN
allow-lists) is refused by name rather than silently ignored: a security setting that looks applied and is
not is worse than none. ``RequestClientCert`` and ``RequireAnyClientCert`` ask for a certificate without
verifying it, which Python's ``ssl`` cannot do, and are refused the same way.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from canaryd.errors import InputError

log = structlog.get_logger("canaryd.daemon")

_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_CACHED = 256  # credentials that passed, kept as a salted digest: bcrypt costs ~0.1–0.3 s per check


@dataclass
class WebConfig:
    """What the listener enforces: a server-side TLS context (None: plain HTTP) and bcrypt-hashed users
    (empty: no authentication)."""

    tls: ssl.SSLContext | None
    users: dict[str, bytes]
    path: Path
    _passed: dict[bytes, None] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _salt: bytes = field(default_factory=lambda: hashlib.sha256(str(id(object())).encode()).digest())

    def authorize(self, header: str | None) -> str | None:
        """None when the request may pass; otherwise why not (a refusal kind, logged once by the caller)."""
        if not self.users:
            return None
        scheme, _, encoded = (header or "").partition(" ")
        if scheme.lower() != "basic" or not encoded:
            return "no credentials"
        try:
            user, sep, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return "malformed credentials"
        hashed = self.users.get(user)
        if not sep or hashed is None:
            return "unknown user"
        key = hmac.new(self._salt, f"{user}\0{password}".encode(), hashlib.sha256).digest()
        with self._lock:
            if key in self._passed:
                return None
        import bcrypt

        try:
            good = bcrypt.checkpw(password.encode(), hashed)
        except ValueError:  # a hash bcrypt cannot read was refused at load; a password over 72 bytes
            good = False
        if not good:
            return "wrong password"
        with self._lock:
            if len(self._passed) >= _CACHED:
                self._passed.pop(next(iter(self._passed)))
            self._passed[key] = None
        return None


class Refusals:
    """Logs each kind of refused connection once per daemon (a misconfigured scraper retries every few
    seconds: the first line says what is wrong, the rest would bury it)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def refused(self, kind: str, peer: object) -> None:
        with self._lock:
            if kind in self._seen:
                return
            self._seen.add(kind)
        log.warning("metrics request refused", reason=kind, peer=str(peer), once=True)


def handshake_refusal(err: ssl.SSLError) -> str:
    """A failed TLS handshake as the kind of refusal it is, in the words an operator searches for."""
    reason = (err.reason or "").upper()
    if reason == "HTTP_REQUEST":
        return "plain HTTP to the TLS port"
    if reason in ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "NO_CERTIFICATE_RETURNED"):
        return "client sent no certificate"
    if reason == "CERTIFICATE_VERIFY_FAILED":
        return "client certificate not trusted"
    if "UNKNOWN_CA" in reason or "BAD_CERTIFICATE" in reason or "CERTIFICATE_UNKNOWN" in reason:
        return "client does not trust the server certificate"
    if "CERTIFICATE_EXPIRED" in reason:
        return "client reports the server certificate expired"
    return f"TLS handshake failed ({err.reason or err.__class__.__name__})"


def load_web_config(path: Path) -> WebConfig:
    """The file at ``path``; an InputError (exit 2) naming the file and the key for anything wrong."""
    import yaml

    where = f"daemon.web_config {path}"
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"{where}: {e.strerror or e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"{where}: not YAML: {' '.join(str(e).split())[:200]}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise InputError(f"{where}: must be a mapping of tls_server_config and basic_auth_users")
    unknown = sorted(set(doc) - {"tls_server_config", "basic_auth_users"})
    if unknown:
        raise InputError(f"{where}: {unknown[0]}: not supported by canaryd (supported: {_SUPPORTED})")
    tls = doc.get("tls_server_config")
    users = doc.get("basic_auth_users") or {}
    if not isinstance(users, dict) or not all(isinstance(k, str) for k in users):
        raise InputError(f"{where}: basic_auth_users: must map user names to bcrypt hashes")
    return WebConfig(
        None if tls is None else _context(tls, path.parent, where),
        {u: _hash(u, h, where) for u, h in users.items()},
        path,
    )


_SUPPORTED = f"tls_server_config ({', '.join(sorted(_TLS_KEYS))}) and basic_auth_users"


def _hash(user: str, value: object, where: str) -> bytes:
    import bcrypt

    hashed = str(value).encode()
    try:
        bcrypt.checkpw(b"", hashed)  # refuses a value that is not a bcrypt hash
    except ValueError:
        raise InputError(f"{where}: basic_auth_users.{user}: not a bcrypt hash ($2a$, $2b$, $2y$)") from None
    return hashed


def _context(tls: object, base: Path, where: str) -> ssl.SSLContext:
    if not isinstance(tls, dict):
        raise InputError(f"{where}: tls_server_config: must be a mapping")
    unknown = sorted(set(tls) - _TLS_KEYS)
    if unknown:
        raise InputError(
            f"{where}: tls_server_config.{unknown[0]}: not supported by canaryd (supported: {_SUPPORTED})"
        )
    for key in ("cert_file", "key_file"):
        if not tls.get(key):
            raise InputError(f"{where}: tls_server_config.{key}: required")
    auth = str(tls.get("client_auth_type") or "NoClientCert")
    if auth not in _CLIENT_AUTH:
        raise InputError(
            f"{where}: tls_server_config.client_auth_type: {auth!r} not supported by canaryd "
            f"(supported: {', '.join(_CLIENT_AUTH)})"
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    bounds = (("min_version", "minimum_version", "TLS12"), ("max_version", "maximum_version", None))
    for key, attr, default in bounds:
        value = tls.get(key) or default
        if value is None:
            continue
        if value not in _VERSIONS:
            raise InputError(f"{where}: tls_server_config.{key}: {value!r} (one of {', '.join(_VERSIONS)})")
        setattr(ctx, attr, _VERSIONS[value])
    cert, key = base / str(tls["cert_file"]), base / str(tls["key_file"])
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise InputError(f"{where}: tls_server_config.cert_file/key_file {cert}, {key}: {_why(e)}") from None
    ctx.verify_mode = _CLIENT_AUTH[auth]
    if auth != "NoClientCert":
        if not tls.get("client_ca_file"):
            raise InputError(f"{where}: tls_server_config.client_ca_file: required for {auth}")
        ca = base / str(tls["client_ca_file"])
        try:
            ctx.load_verify_locations(ca)
        except (OSError, ssl.SSLError) as e:
            raise InputError(f"{where}: tls_server_config.client_ca_file {ca}: {_why(e)}") from None
    return ctx


def _why(e: Exception) -> str:
    if isinstance(e, ssl.SSLError):
        return f"not a usable certificate or key ({e.reason or e})"
    return getattr(e, "strerror", None) or str(e)
