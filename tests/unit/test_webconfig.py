"""The metrics listener behind an exporter-toolkit web config: TLS, client certificates and basic auth, each
refusal at the layer it belongs to (TLS for a plain or untrusting client, 401 for bad credentials), each
kind logged once, and every mistake in the file a one-line error naming the file and the key.

Real TLS on loopback (Python's ``ssl`` as the client); a real Prometheus scrapes the same way in
tests/e2e/test_scrape_tls.py.
"""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
import threading
from pathlib import Path

import bcrypt
import pytest
import structlog
from prometheus_client import CollectorRegistry, Gauge

from canaryd.config import load_config
from canaryd.daemon.httpserver import MetricsServer
from canaryd.daemon.webconfig import load_web_config
from canaryd.errors import InputError
from tests.harness.scripted_lab import free_port
from tests.harness.tls import CA

PASSWORD = "s3cret-scrape"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pki")
    ca, other = CA(root, "main"), CA(root, "other")
    return {
        "root": root,
        "ca": ca,
        "server": ca.issue("server", server=True),
        "expired": ca.issue("expired", server=True, expired=True),
        "client": ca.issue("prometheus", server=False),
        "stranger": other.issue("stranger", server=False),
        "other_ca": other.cert,
    }


def web_file(root: Path, name: str, text: str) -> Path:
    path = root / f"{name}.yml"
    path.write_text(text)
    return path


def serve(web_path: Path):
    registry = CollectorRegistry()
    Gauge("canaryd_up_test", "a series to scrape", registry=registry).set(1)
    server = MetricsServer(("127.0.0.1", free_port()), registry, web=load_web_config(web_path), timeout_s=3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def tls_get(port: int, ctx: ssl.SSLContext, auth: str | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
    headers = {} if auth is None else {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    conn.request("GET", "/metrics", headers=headers)
    return conn.getresponse()


def client(ca: Path, pair=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if pair is not None:
        ctx.load_cert_chain(pair.cert, pair.key)
    return ctx


@pytest.fixture(scope="module")
def tls_auth(pki):
    path = web_file(
        pki["root"],
        "tls-auth",
        f"tls_server_config:\n  cert_file: {pki['server'].cert.name}\n  key_file: {pki['server'].key.name}\n"
        f"basic_auth_users:\n  prometheus: '{HASH}'\n",
    )
    server = serve(path)
    yield server
    server.shutdown()


def test_the_right_password_over_trusted_tls_scrapes(tls_auth, pki):
    r = tls_get(tls_auth.server_port, client(pki["ca"].cert), f"prometheus:{PASSWORD}")
    assert r.status == 200 and b"canaryd_up_test 1.0" in r.read()
    again = tls_get(tls_auth.server_port, client(pki["ca"].cert), f"prometheus:{PASSWORD}")
    assert again.status == 200  # the second check is the cached one


def test_bad_credentials_get_401_and_each_kind_is_logged_once(tls_auth, pki):
    ctx = client(pki["ca"].cert)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            for auth in (f"prometheus:{PASSWORD}x", "nobody:x", None):
                r = tls_get(tls_auth.server_port, ctx, auth)
                assert r.status == 401 and r.getheader("WWW-Authenticate") == 'Basic realm="canaryd"'
                assert b"canaryd_up_test" not in r.read()
    reasons = [e["reason"] for e in logs if e["event"] == "metrics request refused"]
    assert sorted(reasons) == ["no credentials", "unknown user", "wrong password"]  # once each


def test_plain_http_to_the_tls_port_fails_at_the_tls_layer(tls_auth):
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", tls_auth.server_port, timeout=5)
            conn.request("GET", "/metrics")
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                conn.getresponse()
    assert [e["reason"] for e in logs if e["event"] == "metrics request refused"] == [
        "plain HTTP to the TLS port"
    ]


def test_a_client_that_does_not_trust_the_certificate_fails_at_the_tls_layer(tls_auth, pki):
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(ssl.SSLCertVerificationError):
            tls_get(tls_auth.server_port, client(pki["other_ca"]), f"prometheus:{PASSWORD}")
        with socket.create_connection(("127.0.0.1", tls_auth.server_port)):
            pass  # a port check: gone mid-handshake, which is no refusal to log
        tls_get(tls_auth.server_port, client(pki["ca"].cert), f"prometheus:{PASSWORD}").read()
    assert [e["reason"] for e in logs if e["event"] == "metrics request refused"] == [
        "client does not trust the server certificate"
    ]


def test_an_expired_server_certificate_fails_at_the_tls_layer(pki):
    path = web_file(
        pki["root"],
        "expired",
        f"tls_server_config:\n  cert_file: {pki['expired'].cert}\n  key_file: {pki['expired'].key}\n",
    )
    server = serve(path)
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
            tls_get(server.server_port, client(pki["ca"].cert))
    finally:
        server.shutdown()


def test_client_certificates_when_required(pki):
    path = web_file(
        pki["root"],
        "mtls",
        f"tls_server_config:\n  cert_file: {pki['server'].cert}\n  key_file: {pki['server'].key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki['ca'].cert}\n",
    )
    server = serve(path)
    try:
        ok = tls_get(server.server_port, client(pki["ca"].cert, pki["client"]))
        assert ok.status == 200
        with structlog.testing.capture_logs() as logs:
            for pair in (None, pki["stranger"]):
                with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                    tls_get(server.server_port, client(pki["ca"].cert, pair)).read()
            assert tls_get(server.server_port, client(pki["ca"].cert, pki["client"])).status == 200
        reasons = sorted(e["reason"] for e in logs if e["event"] == "metrics request refused")
        assert reasons == ["client certificate not trusted", "client sent no certificate"]
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (
            "tls_server_config:\n  cert_file: a.crt\n  key_file: a.key\n  cipher_suites: [x]\n",
            "cipher_suites",
        ),
        ("http_server_config:\n  http2: false\n", "http_server_config"),
        ("tls_server_config:\n  key_file: a.key\n", "tls_server_config.cert_file: required"),
        ("tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n", "nope.crt"),
        ("basic_auth_users:\n  prometheus: plaintext\n", "basic_auth_users.prometheus: not a bcrypt hash"),
        ("tls_server_config: [1]\n", "tls_server_config: must be a mapping"),
        ("a: [\n", "not YAML"),
        ("- 1\n", "must be a mapping"),
    ],
)
def test_a_bad_web_config_names_the_file_and_the_key(tmp_path, text, names):
    path = web_file(tmp_path, "web", text)
    with pytest.raises(InputError) as err:
        load_web_config(path)
    line = str(err.value)
    assert "\n" not in line and str(path) in line and names in line, line


def test_client_auth_types_python_cannot_honour_are_refused(pki, tmp_path):
    path = web_file(
        tmp_path,
        "any",
        f"tls_server_config:\n  cert_file: {pki['server'].cert}\n  key_file: {pki['server'].key}\n"
        "  client_auth_type: RequireAnyClientCert\n",
    )
    with pytest.raises(InputError, match="client_auth_type: 'RequireAnyClientCert' not supported"):
        load_web_config(path)


def test_the_config_key_resolves_beside_the_config(tmp_path):
    (tmp_path / "suite.toml").write_text('[suite]\nname = "s"\n[[canary]]\nid = "a"\nprompt = "x"\n')
    (tmp_path / "canaryd.toml").write_text(
        'suites = ["suite.toml"]\n[daemon]\nweb_config = "web.yml"\n'
        '[[backends]]\nname = "b"\nkind = "scripted"\n'
    )
    cfg = load_config(tmp_path / "canaryd.toml")
    assert cfg.daemon.web_config == tmp_path / "web.yml"
