"""``canaryd doctor``: what an OpenAI-compatible endpoint accepts and returns, found with a few tiny requests,
and the request profile (``[backends.request]``) that follows from it.

Providers differ in what they refuse (``max_tokens`` on reasoning models, ``seed`` on Mistral,
``presence_penalty`` on grok-4, logprobs on Groq and Gemini) and in what they return (logprobs or not, in
which shape, a fingerprint, reasoning tokens). Reading each provider's documentation to write a profile by
hand is the slow way; asking the endpoint costs a few hundred tokens. Every request is a one-line prompt
capped at `MAX_TOKENS` answer tokens, and there are at most `MAX_REQUESTS`, so the spend printed before
the first one is an upper bound.

A refusal names what it refused (OpenAI's ``param``, pydantic's ``loc``, or the message's words):
`named` reads it, and the next request goes without it. The profile is a plain dict in the shape of the
request profile (``canaryd.backends.profile``); `insert_profile` writes it into the config file's backend
block, leaving every other byte of the file as it was.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from canaryd.backends.base import HttpSettings
from canaryd.backends.detect import constant_fingerprint
from canaryd.errors import InputError

PROMPT = "Say OK."
MAX_TOKENS = 8  # answer tokens per request (a reasoning model's hidden tokens count within it)
RESPONSES_MAX_TOKENS = 16  # the Responses API's smallest max_output_tokens
RESPONSES = "openai-responses"  # the kind that speaks the Responses API (POST /responses)
MAX_REQUESTS = 10
PROMPT_TOKENS = 40  # bound on a one-line prompt's count: the chat template and a provider's own preamble
# The sampling parameters canaryd sends with every canary, at a canary's usual values.
SAMPLING: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "seed": 0,
}
# The Responses API takes no n, penalties or seed.
RESPONSES_SAMPLING: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0}
# When one refusal names several parameters (Claude: "temperature and top_p cannot both be specified"),
# the one canaryd misses least goes first: top_p = 1 and the zero penalties are the defaults anyway.
DROP_FIRST = ("top_p", "presence_penalty", "frequency_penalty", "n", "seed", "temperature")
ALIASES = {"seed": "random_seed"}  # a refused parameter the provider takes under its own name (Mistral)
# Hidden-reasoning budget added to each canary's max_tokens on a reasoning model: room for a low-effort
# answer (OpenAI's reasoning guide suggests reserving far more only for hard problems).
REASONING_BUDGET = 512
# The named preset closest to a host (informative: the measured keys override a preset anyway).
HOST_PRESETS = (
    ("openai.azure.com", "azure"),
    ("api.openai.com", "openai-chat"),
    ("api.anthropic.com", "anthropic-compat"),
    ("generativelanguage.googleapis.com", "gemini-compat"),
    ("openrouter.ai", "openrouter"),
    ("api.groq.com", "groq"),
    ("api.together.xyz", "together"),
    ("api.fireworks.ai", "fireworks"),
    ("api.deepseek.com", "deepseek"),
    ("api.mistral.ai", "mistral"),
    ("api.x.ai", "xai"),
)


class Unreachable(Exception):
    """The endpoint could not be asked (no connection, timeout, 429, 5xx): exit 3."""


def answer_tokens(kind: str) -> int:
    return RESPONSES_MAX_TOKENS if kind == RESPONSES else MAX_TOKENS


def estimate(kind: str = "openai") -> dict[str, int]:
    """The most `discover` can spend: every request at its token bound."""
    return {"requests": MAX_REQUESTS, "tokens": MAX_REQUESTS * (PROMPT_TOKENS + answer_tokens(kind))}


@dataclass
class Reply:
    status: int
    doc: Any  # the parsed JSON body (None when it was not JSON)
    text: str  # the body as text, cut for messages

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass
class Findings:
    """What the endpoint accepted and returned; ``evidence`` says why, per finding."""

    token_param: str = "max_tokens"
    refused: list[str] = field(default_factory=list)  # sampling parameters refused
    logprobs: str = "untested"  # returned | legacy | ignored | refused
    top_logprobs: int = 0  # alternatives returned per token (at most 20 asked)
    completions: bool = False
    fingerprint: str | None = None
    reasoning_tokens: int | None = None  # in the plain answer's usage details
    reasoning_effort: bool | None = None  # None: not tried (not a reasoning model)
    seed_alias: str | None = None
    model: str | None = None
    responses: bool = False  # asked through the Responses API
    evidence: dict[str, str] = field(default_factory=dict)
    requests: int = 0
    tokens: int = 0

    @property
    def reasoning(self) -> bool:
        return bool(self.reasoning_tokens)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def named(reply: Reply, candidates: tuple[str, ...] | list[str]) -> list[str]:
    """The candidate parameters a refusal names: OpenAI's ``error.param``, the last part of a pydantic
    ``loc`` (Mistral's 422), else the words of the message (snake_case or camelCase, as xAI writes them)."""
    doc = reply.doc[0] if isinstance(reply.doc, list) and reply.doc else reply.doc
    err = doc.get("error", doc) if isinstance(doc, dict) else None
    if isinstance(err, dict) and err.get("param") in candidates:
        return [err["param"]]
    locs = re.findall(r'"loc":\s*\[[^\]]*?"([A-Za-z_]+)"\s*\]', reply.text)
    if hits := [p for p in candidates if p in locs]:
        return hits
    message = _said(reply, limit=None)  # the message only: a body's other fields are not its words
    camel = {p: re.sub(r"_([a-z])", lambda m: m.group(1).upper(), p) for p in candidates}
    return [p for p in candidates if re.search(rf"\b({p}|{camel[p]})\b", message)]


class Doctor:
    """Asks one backend; `discover` returns the findings. The key and the connection limits are the
    backend's own (its kind's HTTP client), so what works here works for its probes."""

    def __init__(self, settings: HttpSettings) -> None:
        from canaryd.backends.openai_compat import Prober

        self.cfg = settings
        self.prober = Prober(settings)
        self.found = Findings()
        self.responses = settings.kind == RESPONSES
        self.path = "/responses" if self.responses else "/chat/completions"
        self.sampling = RESPONSES_SAMPLING if self.responses else SAMPLING
        self.found.responses = self.responses
        if self.responses:
            self.found.token_param = "max_output_tokens"

    def close(self) -> None:
        self.prober.close()

    def send(self, path: str, body: dict) -> Reply:
        import httpx2

        from canaryd.backends import openai_compat, transport
        from canaryd.backends import openai_wire as wire

        if self.found.requests >= MAX_REQUESTS:
            raise _Spent
        self.found.requests += 1
        url = f"{self.cfg.base_url}{path}"
        try:
            r = self.prober.exchange(
                "POST", url, content=openai_compat.wire_body(body), headers=openai_compat.JSON
            )
        except (
            transport.DeadlinePassed,
            transport.TooLarge,
            transport.BadEncoding,
            httpx2.TransportError,
        ) as e:
            why = self.prober.redact(str(e).splitlines()[0] if str(e) else e.__class__.__name__)
            raise Unreachable(f"backend {self.cfg.name!r}: {url}: {why}") from None
        text = self.prober.redact(r.text)
        try:
            doc = wire.parse_json(text)
        except wire.InvalidResponse:
            doc = None
        reply = Reply(r.status, doc, text)
        if r.status == 429 or r.status >= 500:
            raise Unreachable(f"backend {self.cfg.name!r}: {url}: HTTP {r.status}: {_said(reply)}")
        if reply.ok:
            self.found.tokens += _spent(doc)
        return reply

    def ask(self, **extra: Any) -> Reply:
        return self.send(self.path, self.body(**extra))

    def body(self, **extra: Any) -> dict:
        if self.responses:
            return {
                "model": self.cfg.model,
                "input": PROMPT,
                "max_output_tokens": RESPONSES_MAX_TOKENS,
                **extra,
            }
        return {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": PROMPT}],
            self.found.token_param: MAX_TOKENS,
            **extra,
        }

    def discover(self) -> Findings:
        f = self.found
        try:
            plain = self._plain()
            answer = plain.doc if isinstance(plain.doc, dict) else {}
            f.model, f.fingerprint = _text(answer.get("model")), _text(answer.get("system_fingerprint"))
            f.reasoning_tokens = _reasoning(plain.doc)
            f.evidence["fingerprint"] = f"plain answer: system_fingerprint {f.fingerprint!r}"
            if engine := constant_fingerprint(f.fingerprint):  # a constant: no serving identity
                f.evidence["fingerprint"] += f", {engine}'s constant: it names no build or weights"
                f.fingerprint = None
            f.evidence["reasoning"] = f"plain answer: reasoning_tokens {f.reasoning_tokens}"
            self._sampling()
            self._logprobs()
            if self.responses:
                f.evidence["completions"] = "not asked: the Responses API has no raw-prompt endpoint"
            else:
                self._completions()
            if f.reasoning:
                r = self.ask(
                    **{"reasoning": {"effort": "low"}} if self.responses else {"reasoning_effort": "low"}
                )
                f.reasoning_effort = r.ok
                f.evidence["reasoning_effort"] = _verdict(r)
            if "seed" in f.refused:
                r = self.ask(**{ALIASES["seed"]: 0})
                f.seed_alias = ALIASES["seed"] if r.ok else None
                f.evidence["seed_alias"] = f"{ALIASES['seed']}: {_verdict(r)}"
        except _Spent:
            f.evidence["stopped"] = f"the cap of {MAX_REQUESTS} requests was reached; the rest is untested"
        return f

    def _plain(self) -> Reply:
        """The plain request: with ``max_tokens``, else (when refused by name) ``max_completion_tokens``."""
        r = self.ask()
        if not r.ok and not self.responses and named(r, ("max_tokens",)):
            self.found.evidence["token_param"] = f"max_tokens: {_verdict(r)}"
            self.found.token_param = "max_completion_tokens"
            r = self.ask()
        if not r.ok:
            raise InputError(
                f"backend {self.cfg.name!r}: {self.cfg.base_url}{self.path} refused a plain request "
                f"(HTTP {r.status}: {_said(r)}): check base_url, model and the API key"
            )
        self.found.evidence.setdefault("token_param", f"{self.found.token_param}: accepted")
        return r

    def _sampling(self) -> None:
        """canaryd's sampling parameters together; each refusal names one, which is dropped."""
        f = self.found
        while True:
            left = [p for p in self.sampling if p not in f.refused]
            r = self.ask(**{p: self.sampling[p] for p in left})
            if r.ok:
                f.evidence["sampling"] = f"accepted: {', '.join(left)}"
                return
            hits = named(r, left)
            if not hits:  # refused without naming a parameter canaryd sent: nothing to omit
                f.evidence["sampling"] = f"refused, no parameter named: {_verdict(r)}"
                return
            drop = next(p for p in DROP_FIRST if p in hits)
            f.refused.append(drop)
            f.evidence[drop] = _verdict(r)

    def _logprobs(self) -> None:
        f = self.found
        kept = {p: v for p, v in self.sampling.items() if p not in f.refused}
        if self.responses:  # logprobs come back only when include asks for them
            r = self.ask(**kept, include=["message.output_text.logprobs"], top_logprobs=20)
        else:
            r = self.ask(**kept, logprobs=True, top_logprobs=20)
        f.evidence["logprobs"] = _verdict(r)
        if not r.ok:
            f.logprobs = "refused"
            return
        if self.responses:
            parts = [p.get("logprobs") for p in _output_text(r.doc)]
            lp = {"content": [e for part in parts if isinstance(part, list) for e in part]}
        else:
            choices = r.doc.get("choices") if isinstance(r.doc, dict) else None
            choice = choices[0] if isinstance(choices, list) and choices else None
            lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if isinstance(lp, dict) and isinstance(lp.get("content"), list) and lp["content"]:
            f.logprobs = "returned"
            f.top_logprobs = max(
                (_count(e.get("top_logprobs")) for e in lp["content"] if isinstance(e, dict)), default=0
            )
        elif isinstance(lp, dict) and isinstance(lp.get("tokens"), list) and lp["tokens"]:
            f.logprobs = "legacy"  # Together, Fireworks: parallel lists inside a chat answer
            tops = lp.get("top_logprobs")
            f.top_logprobs = max(map(_count, tops), default=0) if isinstance(tops, list) else 0
        else:
            f.logprobs = "ignored"
        f.top_logprobs = min(f.top_logprobs, 20)

    def _completions(self) -> None:
        body = {"model": self.cfg.model, "prompt": PROMPT, self.found.token_param: MAX_TOKENS}
        r = self.send("/completions", body)
        self.found.completions = r.ok
        self.found.evidence["completions"] = _verdict(r)


class _Spent(Exception):
    """The request cap was reached."""


def discover(settings: HttpSettings) -> Findings:
    if not isinstance(settings, HttpSettings):
        raise InputError(
            f"backend {settings.name!r}: kind {settings.kind!r} is not reached over HTTP; doctor asks "
            "OpenAI-compatible endpoints only"
        )
    doctor = Doctor(settings)
    try:
        return doctor.discover()
    finally:
        doctor.close()


def engine(settings: HttpSettings) -> dict[str, Any]:
    """Which engine answers at the backend's URL (a few GETs of its own endpoints, no tokens spent) and,
    when the config names a kind that reads less of it, the kind to set (``proposed``)."""
    from canaryd.backends import KINDS
    from canaryd.backends.detect import detect

    try:
        found = detect(settings.base_url, api_key=settings.api_key(), timeout_s=min(settings.timeout_s, 10.0))
    except InputError as e:
        return {"kind": None, "evidence": str(e), "model": None, "proposed": None}
    better = found.kind not in ("openai", settings.kind) and found.kind in KINDS
    return {**found.as_dict(), "proposed": found.kind if better else None}


def profile(f: Findings) -> dict[str, Any]:
    """The ``[backends.request]`` table the findings call for (every key explicit)."""
    p: dict[str, Any] = {"logprobs": "require" if f.logprobs in ("returned", "legacy") else "off"}
    if p["logprobs"] == "require":
        p["top_logprobs"] = f.top_logprobs
    if not f.responses:
        p["token_param"] = f.token_param
    if f.refused:
        p["omit"] = sorted(f.refused)
    extra: dict[str, Any] = {}
    if f.reasoning_effort:  # pinned: a provider's default effort can change under you
        extra.update({"reasoning": {"effort": "low"}} if f.responses else {"reasoning_effort": "low"})
    if f.seed_alias:
        extra[f.seed_alias] = SAMPLING["seed"]
    if extra:
        p["extra_body"] = extra
    if f.reasoning:
        p["reasoning_tokens"] = REASONING_BUDGET
    if not f.responses:  # the Responses kind decides itself where a raw prompt goes
        p["completions"] = f.completions
    return p


def preset_for(base_url: str, f: Findings) -> str | None:
    host = (urlsplit(base_url).hostname or "").lower()
    for suffix, preset in HOST_PRESETS:
        if host == suffix or host.endswith("." + suffix):
            return "openai-reasoning" if preset == "openai-chat" and f.reasoning else preset
    return None


# -- TOML -----------------------------------------------------------------------------------------------
def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        keys = (k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k) for k in v)
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in zip(keys, v.values(), strict=True)) + " }"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def to_toml(p: dict[str, Any], backend: str, preset: str | None = None) -> str:
    lines = ["[backends.request]", f"# measured by `canaryd doctor {backend}`; these keys override a preset"]
    if preset:
        lines.append(f'# the closest named preset (by host) is preset = "{preset}"')
    lines += [f"{k} = {_value(v)}" for k, v in p.items()]
    return "\n".join(lines) + "\n"


_HEADER = re.compile(r"^[ \t]*\[(\[)?[ \t]*([^\[\]#]+?)[ \t]*\]\]?[ \t]*(#.*)?$")


def _key(line: str) -> tuple[bool, str] | None:
    """(array table?, dotted key without spaces or quotes) of a table header line, else None."""
    m = _HEADER.match(line.rstrip("\r\n"))
    if not m:
        return None
    return bool(m.group(1)), re.sub(r"[ \t\"']", "", m.group(2))


def insert_profile(path: Path, backend: str, block: str, p: dict[str, Any]) -> None:
    """Write ``block`` as the backend's ``[backends.request]`` table, replacing one that is there; every
    other line stays byte for byte. The result is parsed again and must be the old document with exactly
    that table set, else nothing is written (`InputError`: paste the block by hand)."""
    text = path.read_text(encoding="utf-8")
    doc = tomllib.loads(text)
    names = [b.get("name") for b in doc.get("backends", [])]
    index = names.index(backend)
    lines = text.splitlines(keepends=True)
    heads = [(i, k) for i, line in enumerate(lines) if (k := _key(line)) is not None]
    starts = [i for i, (array, key) in heads if array and key == "backends"]
    if len(starts) != len(names):
        raise InputError(f"{path}: backend {backend!r} is not a [[backends]] table; paste the block by hand")
    start = starts[index]
    end = next((i for i, (_, key) in heads if i > start and not key.startswith("backends.")), len(lines))
    own = [(i, key) for i, (_, key) in heads if start < i < end]
    drop = set()
    for n, (i, key) in enumerate(own):
        if key == "backends.request" or key.startswith("backends.request."):
            stop = own[n + 1][0] if n + 1 < len(own) else end
            drop.update(range(i, stop))
    kept = [line for i, line in enumerate(lines[start:end], start) if i not in drop]
    while kept and not kept[-1].strip():
        kept.pop()
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    if kept and not kept[-1].endswith(("\n", "\r")):
        kept[-1] += newline
    tail = lines[end:]
    section = [*kept, newline, *block.replace("\n", newline).splitlines(keepends=True)]
    if tail:
        section.append(newline)
    new = "".join(lines[:start] + section + tail)
    expected = json.loads(json.dumps(doc, default=str))
    expected["backends"][index]["request"] = p
    try:
        got = json.loads(json.dumps(tomllib.loads(new), default=str))
    except tomllib.TOMLDecodeError:
        got = None
    if got != expected:
        raise InputError(f"{path}: cannot place [backends.request] for {backend!r} safely; paste it by hand")
    mode = path.stat().st_mode & 0o7777
    tmp = path.with_name(f".{path.name}.doctor")
    tmp.write_text(new, encoding="utf-8", newline="")
    tmp.chmod(mode)
    tmp.replace(path)


# -- reading replies --------------------------------------------------------------------------------------
def _said(r: Reply, limit: int | None = 160) -> str:
    """An error reply's message on one line (cut to ``limit`` characters)."""
    doc = r.doc[0] if isinstance(r.doc, list) and r.doc else r.doc
    msg: Any = None
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        msg = err.get("message") if isinstance(err, dict) else err
    text = msg if isinstance(msg, str) and msg else r.text or "(empty body)"
    return " ".join(text.split())[:limit]


def _verdict(r: Reply) -> str:
    return "accepted" if r.ok else f"HTTP {r.status}: {_said(r)}"


def _spent(doc: Any) -> int:
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")
    return sum(v for k in parts if isinstance(v := usage.get(k), int))


def _reasoning(doc: Any) -> int | None:
    """``reasoning_tokens`` of a chat answer's (or a Responses answer's) usage details."""
    usage = doc.get("usage") if isinstance(doc, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
    n = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _output_text(doc: Any) -> list[dict]:
    """The ``output_text`` parts of a Responses API answer."""
    items = doc.get("output") if isinstance(doc, dict) else None
    parts = [
        c for i in items or () if isinstance(i, dict) for c in i.get("content") or () if isinstance(c, dict)
    ]
    return [p for p in parts if p.get("type") == "output_text"]


def _count(alternatives: Any) -> int:
    """How many top-k alternatives an entry holds (a list, or the legacy token → logprob map)."""
    return len(alternatives) if isinstance(alternatives, list | dict) else 0


def _text(value: Any) -> str | None:
    return None if value is None else str(value)[:200]
