"""Property-based fuzzing of the whole response path, from the bytes a server sends to promtool's parse of
the metrics they end up in.

Hypothesis draws OpenAI chat-completion bodies: the reference answer, near-valid mutations of it (NaN,
infinite, positive and huge logprobs; surrogates, control characters and very long strings in the text,
tokens, fingerprint and model; missing, extra and mistyped fields), arbitrary JSON, and raw bytes (deep
nesting, truncation, invalid UTF-8, NaN literals). A loopback server answers every request with the drawn
body, and everything after it is the product's: the real ``openai`` kind (``make_backend``, the shared
resilience, its HTTP transport, ``openai_wire``), a whole probe pass (``probe.run.probe_backend``) into a
real SQLite store whose baseline is the reference answer, the metrics fold (``daemon.metrics.Metrics``),
the Prometheus text format (``generate_latest``) and ``promtool check metrics``.

Whatever the body, the pass returns (nothing raises), each observation is either judged or an error with a
kind (stored as such; never ``internal``, and ``too_large`` past ``max_response_bytes``), an invalid body
is never judged ``identical`` to the baseline, and promtool parses the exposition (its lint warnings
aside). A bounded number of examples keeps it under a minute; the CI profile (tests/conftest.py) replays
the same examples every run.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from canaryd.backends import make_backend
from canaryd.backends import openai_wire as wire
from canaryd.canaries import load_suites
from canaryd.config import Config, load_config
from canaryd.daemon.metrics import Metrics
from canaryd.judge.verdicts import Verdict
from canaryd.observation import ErrorKind
from canaryd.probe.run import plan, probe_backend
from canaryd.store import Store
from tests.harness.replay import KeepAliveHandler

EXAMPLES = 200
MAX_RESPONSE_BYTES = 256 * 1024  # small, so that some drawn bodies pass it (``too_large``)

SUITE = """
[suite]
name = "fuzz"
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
decoding = { max_tokens = 16, top_logprobs = 2 }
expect = { number = 42, answer = "42" }
"""


def _token(tok: str, lp: float, alt: str, alt_lp: float) -> dict:
    return {
        "token": tok,
        "logprob": lp,
        "bytes": list(tok.encode()),
        "top_logprobs": [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode())},
            {"token": alt, "logprob": alt_lp, "bytes": list(alt.encode())},
        ],
    }


# What the server answered when the baseline was taken; answering it again must be judged ``identical``.
REFERENCE: dict = {
    "id": "chatcmpl-fuzz",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "fuzz-model",
    "system_fingerprint": "fp_reference",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "42"},
            "logprobs": {"content": [_token("4", -0.011, "5", -4.5), _token("2", -0.023, "3", -5.25)]},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 21, "completion_tokens": 2, "total_tokens": 23},
}


# -- strategies -------------------------------------------------------------------------------------------
hostile_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 0.5, 3.0, 1e308, -1e308, 5e-324, -1e-300]),
    st.integers(-(2**80), 2**80),
)
hostile_chars = st.one_of(
    st.characters(),
    st.characters(categories=["Cs"]),  # lone surrogates: valid in JSON (\ud800), not in UTF-8
    st.characters(categories=["Cc", "Cf"]),  # NUL, escapes, bidi overrides, BOM ...
)
hostile_text = st.one_of(
    st.text(hostile_chars, max_size=40),
    st.sampled_from(["", "\x00", "\ud800", "\udfff", "4\ud8002", "a\u202eb", "\ufeff42", "\n42", "\x1b[31m"]),
    # very long: past the label caps, and (as a body) past max_response_bytes
    st.tuples(
        st.sampled_from(["x", "é", "\U0001f600", "\ud800", '"\\']),
        st.one_of(st.integers(1, 5_000), st.sampled_from([100_000, MAX_RESPONSE_BYTES + 1])),
    ).map(lambda t: t[0] * t[1]),
)
scalars = st.one_of(st.none(), st.booleans(), hostile_numbers, hostile_text)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(hostile_chars, max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _nest(depth: int) -> Any:
    value: Any = "42"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


nested = st.integers(1, 60).map(_nest)  # deep, but within what json.dumps itself may write
hostile_values = st.one_of(scalars, json_values, nested)

# Where the reference body's fields are (a list index picks an element; ``None`` marks the body itself).
TOKEN_PATHS = [
    ("choices", 0, "logprobs", "content", i, field) for i in (0, 1) for field in ("logprob", "token", "bytes")
] + [
    ("choices", 0, "logprobs", "content", i, "top_logprobs", j, field)
    for i in (0, 1)
    for j in (0, 1)
    for field in ("logprob", "token")
]
PATHS = [
    (),
    ("model",),
    ("system_fingerprint",),
    ("service_tier",),
    ("usage",),
    ("usage", "prompt_tokens"),
    ("usage", "completion_tokens"),
    ("choices",),
    ("choices", 0),
    ("choices", 0, "message"),
    ("choices", 0, "message", "content"),
    ("choices", 0, "finish_reason"),
    ("choices", 0, "token_ids"),
    ("choices", 0, "logprobs"),
    ("choices", 0, "logprobs", "content"),
    ("choices", 0, "logprobs", "content", 0),
    ("choices", 0, "logprobs", "content", 1, "top_logprobs"),
    *TOKEN_PATHS,
]
LOGPROB_PATHS = [p for p in TOKEN_PATHS if p[-1] == "logprob"]


def _mutate(body: Any, path: tuple, action: str, value: Any, key: str) -> Any:
    """``body`` with the value at ``path`` replaced, deleted, or given an extra key (a no-op where an
    earlier mutation left no such path)."""
    if not path:
        return value if action == "replace" else body
    parent = body
    for step in path[:-1]:
        try:
            parent = parent[step]
        except (KeyError, IndexError, TypeError):
            return body
    last = path[-1]
    try:
        if action == "replace":
            parent[last] = value
        elif action == "delete":
            del parent[last]
        elif isinstance(parent[last], dict):
            parent[last][key] = value
        elif isinstance(parent[last], list):
            parent[last].append(value)
    except (KeyError, IndexError, TypeError):
        pass
    return body


@st.composite
def near_valid(draw) -> Any:
    """The reference body with one to three fields replaced, deleted or given extras."""
    body = copy.deepcopy(REFERENCE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        action = draw(st.sampled_from(["replace", "replace", "delete", "extra"]))
        value = draw(hostile_numbers if path in LOGPROB_PATHS and draw(st.booleans()) else hostile_values)
        body = _mutate(body, path, action, value, draw(st.text(hostile_chars, max_size=8)))
    return body


@st.composite
def plausible(draw) -> dict:
    """A well-formed answer that is not the reference one: other tokens, other (finite, <= 0) logprobs."""
    lp = st.floats(-30, 0, allow_nan=False)
    token = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=4)
    tokens = draw(st.lists(token, max_size=5))
    body = copy.deepcopy(REFERENCE)
    body["choices"][0]["message"]["content"] = "".join(tokens)
    body["choices"][0]["logprobs"]["content"] = [_token(t, draw(lp), "z", draw(lp)) for t in tokens]
    body["system_fingerprint"] = draw(st.sampled_from(["fp_reference", "fp_other"]))
    return body


def _encode(body: Any, ascii_only: bool) -> bytes:
    """JSON as a server might write it: NaN/Infinity literals allowed, surrogates escaped (ASCII) or
    written raw (invalid UTF-8)."""
    return json.dumps(body, allow_nan=True, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


_REF_BYTES = json.dumps(REFERENCE).encode()
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.integers(1, len(_REF_BYTES) - 1).map(lambda n: _REF_BYTES[:n]),  # cut mid-body
    st.integers(1, 100_000).map(
        lambda n: b'{"choices": [{"message": {"content": %s}}]}' % (b"[" * n + b"]" * n)
    ),
    st.integers(1, 100_000).map(lambda n: b"[" * n),
    st.sampled_from(
        [
            b"",
            b"null",
            b"NaN",
            b"\xef\xbb\xbf" + _REF_BYTES,  # a BOM
            _REF_BYTES.replace(b"-0.023", b"NaN"),
            _REF_BYTES.replace(b"-0.023", b"Infinity"),
            _REF_BYTES.replace(b"-0.023", b"1e999"),
            _REF_BYTES.replace(b"-0.023", b"-0.023e-999999"),
            _REF_BYTES.replace(b'"42"', b'"4\\ud8002"'),
            _REF_BYTES.replace(b'"fp_reference"', b'"fp_\\udfff"'),
            _REF_BYTES.replace(b'"42"', b'"4\xff2"'),
            _REF_BYTES + b"garbage",
            _REF_BYTES[:-1] + b', "choices": []}',  # a duplicate key: the last one wins in Python
        ]
    ),
)


def _long_answer(char: str, over: bool) -> bytes:
    """The reference body with an answer that takes it just past (or to well within) the cap."""
    body = copy.deepcopy(REFERENCE)
    n = MAX_RESPONSE_BYTES // len(char.encode()) + 1 if over else 1000
    body["choices"][0]["message"]["content"] = char * n
    return json.dumps(body, ensure_ascii=False).encode()


bodies = st.one_of(
    st.just(_REF_BYTES),
    st.tuples(st.one_of(near_valid(), plausible(), json_values), st.booleans()).map(lambda t: _encode(*t)),
    st.tuples(near_valid(), st.booleans()).map(lambda t: _encode(*t)),
    st.tuples(plausible(), st.booleans()).map(lambda t: _encode(*t)),
    raw_bodies,
    st.builds(_long_answer, st.sampled_from(["x", "é", "\U0001f600"]), st.booleans()),
)


# -- the oracle: which bodies are invalid -----------------------------------------------------------------
def _has_surrogate(value: Any) -> bool:
    return isinstance(value, str) and any("\ud800" <= ch <= "\udfff" for ch in value)


def _bad_logprob(value: Any) -> bool:
    """Not a logprob: a logprob is the log of a probability, a JSON number, finite and <= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    try:
        return not math.isfinite(float(value)) or value > 0
    except OverflowError:  # an integer too large for a float
        return True


def _bad_token(value: Any) -> bool:
    return not isinstance(value, str) or _has_surrogate(value)


def invalid(raw: bytes) -> str | None:
    """Why ``raw`` is not a usable chat completion (None: it is one), by this test's own reading."""
    try:
        payload = json.loads(raw.decode("utf-8-sig"))  # a BOM may be ignored (RFC 8259 section 8.1)
    except (ValueError, RecursionError):
        return "not JSON"
    parse_json = getattr(wire, "parse_json", None)  # the bytes-level parser, where the product has one
    try:
        if parse_json is not None:
            parse_json(raw)
        wire.parse_chat(payload)
    except wire.InvalidResponse as e:
        return f"the parser refuses it: {e}"
    choice = payload["choices"][0]
    message = choice.get("message") or {}
    content = (choice.get("logprobs") or {}).get("content") or []
    for name, value in (
        ("text", message.get("content")),
        ("model", payload.get("model")),
        ("system_fingerprint", payload.get("system_fingerprint")),
        ("service_tier", payload.get("service_tier")),
        ("finish_reason", choice.get("finish_reason")),
    ):
        if _has_surrogate(value):
            return f"a lone surrogate in {name}"
    for i, item in enumerate(content):
        if _bad_logprob(item["logprob"]) or _bad_token(item["token"]):
            return f"token {i} is {item['token']!r} with logprob {item['logprob']!r}"
        for t in item.get("top_logprobs") or ():
            if _bad_logprob(t["logprob"]) or _bad_token(t["token"]):
                return f"token {i} has a top-k entry {t!r}"
    return None


# -- the loopback server and the test bed -----------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    body: bytes = b""


class _Answer(KeepAliveHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = self.server.body  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found on PATH: install Debian's `prometheus` package (it ships promtool)",
            pytrace=False,
        )
    return path


class Bed:
    """A config with one ``openai`` backend on the loopback server, and a store whose baseline is the
    reference answer. Store and backend live for the module, as they do in the daemon: without
    calibration nothing but the baseline carries from one pass to the next, so each example is judged
    against the reference alone (and the newest stored row is its own)."""

    def __init__(self, root: Path, server: _Server) -> None:
        self.server = server
        (root / "fuzz.toml").write_text(SUITE)
        port = server.server_address[1]
        (root / "canaryd.toml").write_text(
            f'state_dir = "state"\nsuites = ["fuzz.toml"]\n'
            f'[[backends]]\nname = "fuzz"\nkind = "openai"\nbase_url = "http://127.0.0.1:{port}/v1"\n'
            f'model = "fuzz-model"\nretries = 0\nbreaker_failures = 1000\ntimeout_s = 20\n'
            f"max_response_bytes = {MAX_RESPONSE_BYTES}\n"
        )
        self.config: Config = load_config(root / "canaryd.toml")
        self.canaries = plan(self.config, load_suites([s.path for s in self.config.suites]))["fuzz"]
        self.store = Store(self.config.storage_url, instance="fuzz")
        self.backend = make_backend(self.config.backend("fuzz"))
        server.body = _REF_BYTES
        run = self.probe()
        assert [r.comparison.verdict for r in run.results] == [Verdict.BASELINE], run.results

    def probe(self):
        return probe_backend(self.backend, self.canaries, self.store, self.config)

    def close(self) -> None:
        self.backend.close()
        self.store.close()


@pytest.fixture(scope="module")
def bed(tmp_path_factory) -> Iterator[Bed]:
    server = _Server(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, name="fuzz-server", daemon=True)
    thread.start()
    b = None
    try:
        b = Bed(tmp_path_factory.mktemp("fuzz"), server)
        yield b
    finally:
        if b is not None:
            b.close()
        server.shutdown()
        server.server_close()


def test_the_reference_answer_is_identical_to_its_baseline(bed):
    """The oracle's anchor: without it, "never identical" would hold for a path that judges nothing."""
    bed.server.body = _REF_BYTES
    (result,) = bed.probe().results
    assert invalid(_REF_BYTES) is None
    assert result.observation.ok and result.comparison.verdict is Verdict.IDENTICAL, result


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(raw=bodies)
def test_any_response_body_is_judged_or_a_named_error_and_renders_for_promtool(bed, raw):
    why_invalid = invalid(raw)
    bed.server.body = raw
    run = bed.probe()  # a whole pass; it must not raise, whatever the body
    stored = bed.store.observations(backend="fuzz", limit=1)

    (result,) = run.results
    obs, verdict = result.observation, result.comparison.verdict
    event(f"verdict {verdict.value}" + (f" ({obs.error_kind.value})" if obs.error_kind else ""))
    if obs.ok:
        assert obs.error_kind is None and verdict not in (Verdict.ERROR, Verdict.BASELINE), (verdict, obs)
    else:
        assert isinstance(obs.error_kind, ErrorKind) and verdict is Verdict.ERROR, (verdict, obs)
        assert obs.error and "\n" not in obs.error, obs.error
        # a body is the server's doing: named for what is wrong with it, never an exception that escaped
        assert obs.error_kind is not ErrorKind.INTERNAL, f"a response body raised in canaryd: {obs.error}"
    if len(raw) > MAX_RESPONSE_BYTES:  # the backend's max_response_bytes: not read further, never judged
        assert obs.error_kind is ErrorKind.TOO_LARGE, (len(raw), verdict, obs.error)
    if why_invalid is not None:
        assert verdict is not Verdict.IDENTICAL, f"an invalid body ({why_invalid}) was judged identical"
    # stored as judged
    assert stored[0].id == result.observation_id and stored[0].verdict == verdict.value
    assert stored[0].error_kind == (obs.error_kind.value if obs.error_kind else None)

    metrics = Metrics()
    metrics.set_intervals([("fuzz", "add", 60.0)])
    metrics.record(run)
    exposition = generate_latest(metrics.registry)
    one_hot = [
        metrics.registry.get_sample_value(
            "canaryd_canary_verdict", {"backend": "fuzz", "canary": "add", "verdict": v.value}
        )
        for v in Verdict
    ]
    assert [v for v in one_hot if v is not None] == [1.0], one_hot  # only the current verdict's series
    proc = subprocess.run(
        [_promtool(), "check", "metrics"], input=exposition, capture_output=True, timeout=60, check=False
    )
    report = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    # 0: clean; 3: lint findings only (e.g. a missing HELP); anything else is a parse failure
    assert proc.returncode in (0, 3) and "error" not in report.lower(), (proc.returncode, report[:2000])
