"""What an OpenAI-compatible endpoint accepts and returns, found with a few tiny requests (``canaryd
doctor``), and the request profile (``[backends.request]``) that follows from it.

Providers differ in what they refuse (``max_tokens`` on reasoning models, ``seed`` on Mistral,
``presence_penalty`` on grok-4, logprobs on Groq and Gemini) and in what they return (logprobs or not, in
which shape, a fingerprint, reasoning tokens). Reading each provider's documentation to write a profile by
hand is the slow way; asking the endpoint costs a few hundred tokens. Every request is a one-line prompt
capped at `MAX_TOKENS` answer tokens, and there are at most `MAX_REQUESTS`, so the spend printed before
the first one is an upper bound.

A refusal names what it refused (OpenAI's ``param``, pydantic's ``loc``, or the message's words):
`named` reads it, and the next request goes without it. A server that caps top-k logprobs (vLLM's
``--max-logprobs``, TGI's ``--max-top-n-tokens``) keeps its logprobs: the cap its refusal names is asked
next, and a refusal of ``top_logprobs`` that names no cap is bisected over a few more requests, so the
profile asks for the largest top-k the server accepts instead of turning logprobs off. The profile is a
plain dict in the shape of the request profile (``canaryd.backends.profile``, which also writes it into
the config file).

The requests go through the backend's own kind: its ``Prober`` (the key, the connection limits, the wire
form of a body) and its API's shape, the chat completions `Dialect` unless the kind declares another
(``DOCTOR``, as the Responses API's kind does).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

from canaryd.backends import declared, refusals
from canaryd.backends.base import HttpSettings
from canaryd.backends.detect import constant_fingerprint
from canaryd.backends.profile import TOP_K_MAX
from canaryd.errors import InputError

PROMPT = "Say OK."
MAX_TOKENS = 8  # answer tokens per request (a reasoning model's hidden tokens count within it)
MAX_REQUESTS = 10
AFTER_LOGPROBS = 3  # requests kept for what is asked after logprobs (/completions, reasoning effort, seed)
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


class Dialect:
    """How doctor asks an API: the chat completions (``POST /chat/completions``), unless the kind's module
    declares its own as ``DOCTOR`` (an object with these attributes and methods)."""

    path = "/chat/completions"
    responses = False  # the Responses API (the findings and the profile say so)
    token_param = "max_tokens"
    fallback_token_param: str | None = "max_completion_tokens"  # when the first is refused by name
    max_tokens = MAX_TOKENS
    sampling = SAMPLING
    no_completions: str | None = None  # why there is no raw-prompt endpoint (/completions) to ask about
    reasoning: ClassVar[dict[str, Any]] = {"reasoning_effort": "low"}

    def body(self, model: str, token_param: str, **extra: Any) -> dict:
        return {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            token_param: self.max_tokens,
            **extra,
        }

    def ask_logprobs(self, k: int) -> dict[str, Any]:
        return {"logprobs": True, "top_logprobs": k}

    def logprobs(self, doc: Any) -> Any:
        """The answer's logprobs object (``content`` entries, or the legacy parallel lists)."""
        choices = doc.get("choices") if isinstance(doc, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        return choice.get("logprobs") if isinstance(choice, dict) else None


def dialect(kind: str) -> Dialect:
    return declared(kind, "DOCTOR", None) or Dialect()


def answer_tokens(kind: str) -> int:
    return dialect(kind).max_tokens


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
    top_logprobs: int = 0  # alternatives returned per token (at most TOP_K_MAX asked, fewer under a cap)
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
        self.cfg = settings
        self.prober = declared(settings.kind, "Prober")(settings)
        self.api = dialect(settings.kind)
        self.found = Findings(token_param=self.api.token_param, responses=self.api.responses)

    def close(self) -> None:
        self.prober.close()

    def send(self, path: str, body: dict) -> Reply:
        from canaryd.backends import openai_wire as wire

        if self.found.requests >= MAX_REQUESTS:
            raise _Spent
        self.found.requests += 1
        url = f"{self.cfg.base_url}{path}"
        try:
            status, text = self.prober.post(url, body)
        except ConnectionError as e:
            raise Unreachable(f"backend {self.cfg.name!r}: {url}: {e}") from None
        try:
            doc = wire.parse_json(text)
        except wire.InvalidResponse:
            doc = None
        reply = Reply(status, doc, text)
        if status == 429 or status >= 500:
            raise Unreachable(f"backend {self.cfg.name!r}: {url}: HTTP {status}: {_said(reply)}")
        if reply.ok:
            self.found.tokens += _spent(doc)
        return reply

    def ask(self, **extra: Any) -> Reply:
        return self.send(self.api.path, self.api.body(self.cfg.model, self.found.token_param, **extra))

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
            if self.api.no_completions is None:
                self._completions()
            else:
                f.evidence["completions"] = f"not asked: {self.api.no_completions}"
            if f.reasoning:
                r = self.ask(**self.api.reasoning)
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
        first, fallback = self.found.token_param, self.api.fallback_token_param
        if not r.ok and fallback is not None and named(r, (first,)):
            self.found.evidence["token_param"] = f"{first}: {_verdict(r)}"
            self.found.token_param = fallback
            r = self.ask()
        if not r.ok:
            raise InputError(
                f"backend {self.cfg.name!r}: {self.cfg.base_url}{self.api.path} refused a plain request "
                f"(HTTP {r.status}: {_said(r)}): check base_url, model and the API key"
            )
        self.found.evidence.setdefault("token_param", f"{self.found.token_param}: accepted")
        return r

    def _sampling(self) -> None:
        """canaryd's sampling parameters together; each refusal names one, which is dropped."""
        f = self.found
        while True:
            left = [p for p in self.api.sampling if p not in f.refused]
            r = self.ask(**{p: self.api.sampling[p] for p in left})
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
        r = self._top_k(TOP_K_MAX)
        f.evidence["logprobs"] = _verdict(r)
        if not r.ok and (cap := refusals.top_k_limit(r.status, r.text)) is not None:
            r = self._top_k(cap)
            f.evidence["logprobs"] += f"; top {cap}, the cap it names: {_verdict(r)}"
        elif not r.ok and r.status in (400, 422) and named(r, ("top_logprobs",)):
            r = self._largest_top_k()
        if not r.ok:
            f.logprobs = "refused"
            return
        lp = self.api.logprobs(r.doc)
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
        f.top_logprobs = min(f.top_logprobs, TOP_K_MAX)

    def _top_k(self, k: int) -> Reply:
        kept = {p: v for p, v in self.api.sampling.items() if p not in self.found.refused}
        return self.ask(**kept, **self.api.ask_logprobs(k))

    def _largest_top_k(self) -> Reply:
        """After a ``top_logprobs`` refusal that names no cap: top 1, then bisection between the largest
        top-k accepted and the smallest refused, while the request cap leaves room for the questions after
        it. Returns the reply of the largest accepted (or the refusal of top 1: no logprobs at all)."""
        evidence = self.found.evidence
        best = self._top_k(1)
        evidence["logprobs"] += f"; top 1: {_verdict(best)}"
        if not best.ok:
            return best
        lo, hi = 1, TOP_K_MAX
        while hi - lo > 1 and MAX_REQUESTS - self.found.requests > AFTER_LOGPROBS:
            mid = (lo + hi) // 2
            r = self._top_k(mid)
            if r.ok:
                best, lo = r, mid
            else:
                hi = mid
        evidence["logprobs"] += f"; bisected: top {lo} accepted, top {hi} refused"
        return best

    def _completions(self) -> None:
        body = {"model": self.cfg.model, "prompt": PROMPT, self.found.token_param: self.api.max_tokens}
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


def _count(alternatives: Any) -> int:
    """How many top-k alternatives an entry holds (a list, or the legacy token → logprob map)."""
    return len(alternatives) if isinstance(alternatives, list | dict) else 0


def _text(value: Any) -> str | None:
    return None if value is None else str(value)[:200]
