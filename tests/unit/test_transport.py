"""The HTTP kinds' single attempt against a misbehaving loopback server (harness loopback): ``timeout_s``
is a deadline for the whole request however the server drips, a body is never read past
``max_response_bytes``, every failure keeps its error kind, and the request on the wire did not change when
the openai SDK left the probe path. Also the retries' stop (`Resilient.stopping`).

The same faults in front of a real vLLM are in tests/e2e/test_faults.py.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import tracemalloc

import httpx2
import pytest

from canaryd.backends import BackendUnavailable, make_backend
from canaryd.backends.openai_compat import Settings as OpenAISettings
from canaryd.backends.vllm_server import Settings as VLLMSettings
from canaryd.canaries import Canary
from canaryd.observation import ErrorKind
from tests.harness.loopback import BIG, Loopback

CHAT = Canary(id="c", messages=[{"role": "user", "content": "hi é"}], suite="s", decoding={"seed": 3})
RAW = Canary(id="r", prompt="The colors", suite="s")
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def server():
    with Loopback(drip_s=1.0) as s:
        yield s


def backend(server: Loopback, mode: str, kind: type = OpenAISettings, **settings):
    values = {"timeout_s": TIMEOUT_S, "retries": 0, "retry_backoff": 0, **settings}
    return make_backend(kind(name="b", model="m", base_url=server.base(mode), **values))


def timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


@pytest.mark.parametrize("mode", ["drip-body", "drip-headers", "hang"])
def test_timeout_s_is_a_deadline_for_the_whole_request_however_the_server_drips(server, mode):
    b = backend(server, mode)
    try:
        obs, took = timed(lambda: b.attempt(CHAT))
    finally:
        b.close()
    assert obs.error_kind is ErrorKind.TIMEOUT, obs.error
    assert obs.error.startswith(f"deadline of {TIMEOUT_S:g}s passed after ")
    assert TIMEOUT_S - 0.05 <= took < TIMEOUT_S + 1, took
    assert obs.latency_s == pytest.approx(took, abs=0.1)


def test_a_pooled_connection_that_starts_dripping_is_bounded_too(server):
    """The connection an introspection call left in the pool carries the next probe, whose headers drip."""
    b = backend(server, "drip-headers")
    try:
        assert b.prober.call("GET", f"{server.url}/ok/v1/models").json()["data"][0]["id"] == "m"
        obs, took = timed(lambda: b.attempt(CHAT))
        assert obs.error_kind is ErrorKind.TIMEOUT and took < TIMEOUT_S + 1, (obs.error, took)
        # and the pool goes on working: the dripping connection is gone, not handed out again
        assert b.prober.call("GET", f"{server.url}/ok/version").json() == {"version": "0.0.test"}
    finally:
        b.close()


def test_the_vllm_snapshot_calls_have_the_deadline_and_stop_between_calls(server):
    b = backend(server, "ok", VLLMSettings)
    try:
        assert b.snapshot()["template.token_count"] == "3"
        with pytest.raises(httpx2.HTTPStatusError) as status:  # a section's error, as before
            b.prober.call("GET", f"{server.url}/503-big/version")
        assert status.value.response.status_code == 503
    finally:
        b.close()
    b = backend(server, "drip-body", VLLMSettings)
    try:
        with pytest.raises(BackendUnavailable) as err:
            timed(b.snapshot)
        assert err.value.kind is ErrorKind.TIMEOUT and "deadline of 2s passed" in str(err.value)
        before = len(server.requests)
        b.stopping.set()
        with pytest.raises(BackendUnavailable) as err:
            b.snapshot()
        assert err.value.kind is ErrorKind.STOPPED and len(server.requests) == before  # nothing sent
    finally:
        b.close()
    b = backend(server, "ok", VLLMSettings)
    version = b.prober._version
    b.prober._version = lambda: (version(), b.stopping.set())[0]  # the stop comes during the first call
    try:
        with pytest.raises(BackendUnavailable) as err:
            b.snapshot()
        assert err.value.kind is ErrorKind.STOPPED
        assert server.requests[-1].path == "/ok/version"  # the calls after it were not made
    finally:
        b.close()


@pytest.mark.parametrize("mode", ["big", "big-declared", "gzip-bomb"])
def test_a_body_over_the_cap_is_too_large_and_never_held(server, mode):
    b = backend(server, mode, timeout_s=30)
    gc.collect()
    tracemalloc.start()
    try:
        obs, took = timed(lambda: b.attempt(CHAT))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        b.close()
    assert obs.error_kind is ErrorKind.TOO_LARGE, obs.error
    assert "8388608-byte cap" in obs.error and obs.text is None and obs.tokens == []
    assert peak < 50 << 20, f"{mode}: peak {peak / 2**20:.1f} MiB for a {BIG / 1e6:.0f} MB body"
    assert took < 10


def test_the_cap_is_the_backends_own(server):
    b = backend(server, "big", max_response_bytes=1024)
    try:
        obs = b.attempt(CHAT)
    finally:
        b.close()
    assert obs.error_kind is ErrorKind.TOO_LARGE and "1024-byte cap" in obs.error


@pytest.mark.parametrize(
    ("mode", "kind", "error"),
    [
        ("429", ErrorKind.RATE_LIMITED, "HTTP 429: slow down"),
        ("503", ErrorKind.HTTP_5XX, "HTTP 503: overloaded"),
        ("503-big", ErrorKind.HTTP_5XX, "HTTP 503: <html>overloadedxxx"),  # a 503 still, read in part
        ("nosuchmode", ErrorKind.HTTP_4XX, "HTTP 404: no such mode"),
        ("cut", ErrorKind.TRUNCATED, "RemoteProtocolError: peer closed connection"),
        ("badjson", ErrorKind.INVALID_RESPONSE, "body is not JSON"),
    ],
)
def test_every_failure_keeps_its_error_kind(server, mode, kind, error):
    b = backend(server, mode)
    try:
        obs = b.attempt(CHAT)
    finally:
        b.close()
    assert obs.error_kind is kind and obs.error.startswith(error), obs.error
    assert obs.headers == ({"retry-after": "7"} if mode == "429" else {})  # allow-listed headers only


def test_the_api_key_is_sent_and_never_recorded(server, monkeypatch):
    monkeypatch.setenv("CANARYD_TEST_KEY", "sk-secret-123")
    b = backend(server, "401", api_key_env="CANARYD_TEST_KEY")
    try:
        obs = b.attempt(CHAT)
    finally:
        b.close()
    assert server.requests[-1].headers["authorization"] == "Bearer sk-secret-123"
    assert obs.error_kind is ErrorKind.AUTH
    assert obs.error == "HTTP 401: bad key in Bearer <redacted>"


def test_connection_refused_is_connect():
    with Loopback() as gone:
        url = gone.base("ok")
    b = make_backend(OpenAISettings(name="b", model="m", base_url=url, retries=0))
    try:
        obs = b.attempt(CHAT)
    finally:
        b.close()
    assert obs.error_kind is ErrorKind.CONNECT, obs.error


@pytest.mark.parametrize("mode", ["ok", "gzip"])
def test_a_good_answer_is_parsed_with_its_logprobs_and_serving_facts(server, mode):
    b = backend(server, mode)
    try:
        chat, raw = b.attempt(CHAT), b.attempt(RAW)
    finally:
        b.close()
    assert chat.ok and chat.text == "42" and [t.token for t in chat.tokens] == ["42"]
    assert chat.tokens[0].top == (("42", -0.01), ("4", -5.0)) and chat.tokens[0].bytes == (52, 50)
    assert chat.system_fingerprint == "fp_loopback" and chat.completion_tokens == 1
    assert chat.stack["response.system_fingerprint"] == "fp_loopback"
    assert raw.ok and raw.text == " blue" and raw.tokens[0].logprob == -0.1
    assert server.requests[-1].headers["accept-encoding"] == "gzip, deflate"


# What the openai SDK (3.60) put on the wire for CHAT before canaryd sent requests itself.
SDK_CHAT_BODY = {
    "openai": b'{"model":"m","messages":[{"role":"user","content":"hi \xc3\xa9"}],"frequency_penalty":0.0,'
    b'"logprobs":true,"max_tokens":32,"n":1,"presence_penalty":0.0,"seed":3,"temperature":0.0,'
    b'"top_logprobs":5,"top_p":1.0}',
    "vllm": b'{"model":"m","messages":[{"role":"user","content":"hi \xc3\xa9"}],"frequency_penalty":0.0,'
    b'"logprobs":true,"max_tokens":32,"n":1,"presence_penalty":0.0,"seed":3,"temperature":0.0,'
    b'"top_logprobs":5,"top_p":1.0,"top_k":-1,"min_p":0.0,"repetition_penalty":1.0,"return_token_ids":true,'
    b'"return_tokens_as_token_ids":true}',
}
SDK_RAW_BODY = (
    b'{"model":"m","prompt":"The colors","frequency_penalty":0.0,"logprobs":5,"max_tokens":32,"n":1,'
    b'"presence_penalty":0.0,"seed":0,"temperature":0.0,"top_p":1.0}'
)


@pytest.mark.parametrize(("kind", "settings"), [("openai", OpenAISettings), ("vllm", VLLMSettings)])
def test_the_request_on_the_wire_is_byte_for_byte_what_the_sdk_sent(server, kind, settings):
    b = backend(server, "ok", settings)
    try:
        obs = b.attempt(CHAT)
        sent = server.requests[-1]
        assert sent.method == "POST" and sent.path == "/ok/v1/chat/completions"
        assert sent.body == SDK_CHAT_BODY[kind]
        assert json.loads(sent.body) == obs.request == b.request(CHAT)
        assert obs.request_hash == b.request_hash(CHAT)
        if kind == "openai":
            b.attempt(RAW)
            assert (
                server.requests[-1].path == "/ok/v1/completions" and server.requests[-1].body == SDK_RAW_BODY
            )
    finally:
        b.close()


def test_the_openai_sdk_is_not_imported_by_a_probe(server):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from canaryd.backends import make_backend\n"
        "from canaryd.backends.vllm_server import Settings\n"
        "from canaryd.canaries import Canary\n"
        f"b = make_backend(Settings(name='b', model='m', base_url={server.base('ok')!r}))\n"
        "assert b.probe(Canary(id='c', prompt='x', suite='s')).ok\n"
        "b.snapshot()\n"
        "assert 'openai' not in sys.modules, 'openai SDK imported'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


# -- the retries' stop -------------------------------------------------------------------------------------
def test_a_stop_ends_a_backoff_wait_and_starts_no_attempt(server):
    b = backend(server, "503", retries=5, retry_backoff=30)
    try:
        threading.Timer(0.5, b.stopping.set).start()
        obs, took = timed(lambda: b.probe(CHAT))
        assert took < 2, took  # not 30 s of backoff, nor 5 more attempts
        assert obs.error_kind is ErrorKind.HTTP_5XX and obs.attempts == 1
        assert obs.error.endswith("(not retried: canaryd is stopping)")
        sent = len(server.requests)
        unsent = b.probe(RAW)
        assert (
            unsent.error_kind is ErrorKind.STOPPED and unsent.attempts == 0 and len(server.requests) == sent
        )
        assert unsent.request == b.request(RAW) and unsent.request_hash == b.request_hash(RAW)
        assert b.breaker.state == "closed"
    finally:
        b.close()


def test_retries_without_a_stop_go_on_as_configured(server):
    b = backend(server, "429", retries=2, retry_max_wait=0)  # Retry-After: 7, capped to no wait
    try:
        obs = b.probe(CHAT)
    finally:
        b.close()
    assert obs.error_kind is ErrorKind.RATE_LIMITED and obs.attempts == 3
    assert obs.error == "HTTP 429: slow down (after 3 attempts)" and obs.headers == {"retry-after": "7"}


def test_the_deadline_timer_alone_ends_a_blocked_read(server, monkeypatch):
    """Belt and braces: were an operation's timeout not clamped to the deadline, the timer at the deadline
    still shuts its socket down, and the attempt ends on time."""
    from canaryd.backends import transport

    monkeypatch.setattr(transport.Deadline, "left", lambda self, timeout, error: timeout)
    b = backend(server, "drip-headers")
    try:
        obs, took = timed(lambda: b.attempt(CHAT))
    finally:
        b.close()
    assert obs.error_kind is ErrorKind.TIMEOUT and took < TIMEOUT_S + 1, (obs.error, took)


def test_bodies_inflate_in_steps_under_the_cap():
    import gzip
    import zlib

    from canaryd.backends.transport import BadEncoding, TooLarge, _Body

    data = json.dumps([{"token": str(i), "logprob": -i / 7} for i in range(20_000)]).encode()  # ~0.6 MB
    for encoding, packed in (("gzip", gzip.compress(data)), ("deflate", zlib.compress(data)), (None, data)):
        body = _Body(cap=len(data))
        body.encoded(encoding)
        for i in range(0, len(packed), 1000):  # as the network hands it over
            body.add(packed[i : i + 1000])
        assert bytes(body) == data, encoding
        body = _Body(cap=len(data) - 1)
        body.encoded(encoding)
        with pytest.raises(TooLarge):
            body.add(packed)
    body = _Body(cap=1 << 20)
    body.encoded("gzip")
    with pytest.raises(BadEncoding, match="does not inflate"):
        body.add(b"not gzip at all")
    with pytest.raises(BadEncoding, match="unsupported content-encoding 'br'"):
        _Body(cap=1 << 20).encoded("br")
