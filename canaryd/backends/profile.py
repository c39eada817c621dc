"""Request profiles: what an HTTP backend is sent beyond what the canary decides, per provider family.

Providers accept different subsets of the OpenAI request (`docs/profiles.md` has the table with sources):
reasoning models take ``max_completion_tokens`` and no temperature, Groq refuses ``logprobs``, Mistral
``seed``, Anthropic and Gemini return no logprobs at all. A ``[[backends]]`` block says what to send with a
``preset`` (one per family, `PRESETS`) and/or a ``[backends.request]`` table (a `RequestProfile`); explicit
keys override the preset's. The effective profile is hashed into the stack field ``request.profile``, so
changing it is a stack change (the canary's baseline key, `Prober.request_hash`, does not move).

`to_toml` and `insert_profile` write a profile (the one `canaryd doctor` measures) into a config file's
backend block, leaving every other byte of the file as it was.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli
from pydantic import Field, field_validator

from canaryd.errors import InputError
from canaryd.fields import Strict

# Request parameters a profile may leave out (the model and the prompt are always sent).
Param = Literal[
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "stop",
    "logprobs",
    "top_logprobs",
]
# Body keys extra_body may not replace: they carry the canary itself.
RESERVED = frozenset({"model", "messages", "prompt", "input"})
MAX_REASONING_TOKENS = 1 << 20
TOP_K_MAX = 20  # the most top-k alternatives a profile asks for (OpenAI's own cap)


class RequestProfile(Strict):
    """``[backends.request]``: how a canary becomes a request for this backend."""

    # require: an answer without logprobs is an error (``no_logprobs``); prefer: asked for, and an answer
    # without them is judged on text; off: not asked for.
    logprobs: Literal["require", "prefer", "off"] = "prefer"
    top_logprobs: Annotated[int, Field(ge=0, le=TOP_K_MAX)] = TOP_K_MAX  # cap on the canary's own top-k
    token_param: Literal["max_tokens", "max_completion_tokens", "none"] = "max_tokens"
    omit: tuple[Param, ...] = ()
    extra_body: dict[str, Any] = Field(default_factory=dict)  # merged into every body last, verbatim
    reasoning_tokens: Annotated[int, Field(ge=0, le=MAX_REASONING_TOKENS)] = 0  # added to max_tokens
    completions: bool = True  # False: no legacy /completions endpoint, raw-prompt canaries are refused

    @field_validator("extra_body")
    @classmethod
    def _json_body(cls, v: dict[str, Any]) -> dict[str, Any]:
        if reserved := sorted(RESERVED & v.keys()):
            raise ValueError(f"{reserved[0]!r} is the canary's own; extra_body may not replace it")
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as e:  # a TOML date or time, an inf or nan float
            raise ValueError(f"not JSON ({e})") from None
        return v

    def digest(self) -> str:
        """A short hash of everything the profile sends: the stack field ``request.profile``."""
        doc = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(doc.encode()).hexdigest()[:12]


DEFAULT = RequestProfile()

# One profile per provider family; each comment says what it sends and why, with the source (a provider
# documentation page, or the issue thread where the provider's answer was recorded).
PRESETS: dict[str, RequestProfile] = {
    # OpenAI chat models (gpt-4o, gpt-4.1): logprobs with up to 20 alternatives; max_tokens is deprecated
    # for max_completion_tokens; /v1/completions answers 404 "This is a chat model" (tmc/langchaingo#201).
    # https://platform.openai.com/docs/api-reference/chat/create
    "openai-chat": RequestProfile(token_param="max_completion_tokens", completions=False),
    # OpenAI reasoning models (o-series, gpt-5.x): 400 on max_tokens (griptape#312, gollm#33) and on any
    # temperature but 1 (langchaingo#1355, llmcomp#69); o4-mini answers logprobs with 403 (deepeval#2184).
    # The effort is pinned (a provider default may move) and hidden reasoning gets its own budget.
    # https://platform.openai.com/docs/guides/reasoning
    "openai-reasoning": RequestProfile(
        logprobs="off",
        token_param="max_completion_tokens",
        omit=("temperature", "top_p", "presence_penalty", "frequency_penalty"),
        extra_body={"reasoning_effort": "low"},
        reasoning_tokens=2048,
        completions=False,
    ),
    # Azure OpenAI: the OpenAI rules per deployed model; gpt-5.1 deployments 400 on max_tokens
    # (anomalyco/opencode#37964), gpt-5.2 returns logprobs (litellm#18856).
    # https://learn.microsoft.com/azure/ai-foundry/openai/reference
    "azure": RequestProfile(token_param="max_completion_tokens", completions=False),
    # Anthropic's OpenAI SDK compatibility: logprobs, seed and penalties are ignored (never returned), and
    # Claude >= 4.1 refuses temperature and top_p together (open-webui/pipelines#546, ChatterUI#564).
    # https://docs.anthropic.com/en/api/openai-sdk
    "anthropic-compat": RequestProfile(
        logprobs="off", omit=("top_p", "seed", "presence_penalty", "frequency_penalty"), completions=False
    ),
    # Gemini's OpenAI compatibility: 400 "Logprobs is not enabled" (think-reason-learn#34), none on 3.5
    # Flash (GoogleCloudPlatform/generative-ai#2947); penalties are not part of the compatible subset.
    # https://ai.google.dev/gemini-api/docs/openai
    "gemini-compat": RequestProfile(
        logprobs="off", omit=("presence_penalty", "frequency_penalty"), completions=False
    ),
    # OpenRouter: logprobs only from providers that pass them through (SillyTavern#5804); the provider
    # that answered is the body's `provider` field (langchain#39298), recorded as response.provider. Pin one
    # with extra_body = { provider = { order = [...], allow_fallbacks = false, require_parameters = true } }.
    # https://openrouter.ai/docs/api-reference/parameters
    "openrouter": RequestProfile(),
    # Groq: 400 on logprobs and top_logprobs; temperature 0 is rewritten to 1e-8; chat only.
    # https://console.groq.com/docs/openai
    "groq": RequestProfile(logprobs="off", completions=False),
    # Together: `logprobs` is an integer 0-20 (togethercomputer/openapi#104), answered in the legacy
    # tokens/token_logprobs lists inside chat responses (together-python#251).
    # https://docs.together.ai/reference/chat-completions-1
    "together": RequestProfile(omit=("top_logprobs",), extra_body={"logprobs": 5}),
    # Fireworks: legacy logprob lists in chat responses; penalties listed as unsupported in older docs.
    # https://docs.fireworks.ai/api-reference/post-chatcompletions
    "fireworks": RequestProfile(omit=("presence_penalty", "frequency_penalty")),
    # DeepSeek: deepseek-chat returns logprobs (top 0-20); deepseek-reasoner does not (add logprobs = "off");
    # no legacy completions outside the beta FIM endpoint.
    # https://api-docs.deepseek.com/api/create-chat-completion
    "deepseek": RequestProfile(completions=False),
    # Mistral: `seed` is a 422 extra_forbidden (ChatterUI#143), the name there is random_seed; logprobs
    # are not documented (an unknown field is refused), so they are off.
    # https://docs.mistral.ai/api/#tag/chat
    "mistral": RequestProfile(
        logprobs="off", omit=("seed",), extra_body={"random_seed": 0}, completions=False
    ),
    # xAI: grok-4.x answers presence_penalty with 400 (NativeTavern#83, open-webui#21266), and lists
    # frequency_penalty and stop as unsupported for reasoning models; hidden reasoning needs a budget.
    # https://docs.x.ai/docs/guides/reasoning
    "xai": RequestProfile(
        omit=("presence_penalty", "frequency_penalty", "stop"), reasoning_tokens=1024, completions=False
    ),
}


def check_preset(name: str | None) -> str | None:
    """``name`` if it is a preset (or None), else a ValueError listing the known ones."""
    if name is not None and name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return name


def effective(preset: str | None, explicit: RequestProfile) -> RequestProfile:
    """The preset with the keys given in ``[backends.request]`` overriding it (``extra_body`` tables are
    merged key by key, the explicit value winning)."""
    base = PRESETS[preset] if preset is not None else DEFAULT
    update = {k: getattr(explicit, k) for k in explicit.model_fields_set}
    if "extra_body" in update:
        update["extra_body"] = {**base.extra_body, **explicit.extra_body}
    return base.model_copy(update=update) if update else base


def without_completions(config: Any, suites: Iterable[Any], only: str | None = None) -> str | None:
    """The first raw-prompt canary a config binds to a backend (``only``: that one) that has no
    completions endpoint, as a one-line error; None when there is none. Suites follow their refs' optional
    ``backends`` list, as the probe plan does."""
    for backend in config.backends:
        why = getattr(backend, "no_completions", None)
        if why is None or only not in (None, backend.name):
            continue
        for ref, suite in zip(config.suites, suites, strict=True):
            if ref.backends is not None and backend.name not in ref.backends:
                continue
            for canary in suite.canaries:
                parts = canary.steps if canary.steps is not None else (canary,)
                if any(p.prompt is not None for p in parts):
                    return (
                        f"{config.path}: canary {canary.id!r} (suite {suite.name!r}) is a raw prompt, but "
                        f"backend {backend.name!r} has no completions endpoint ({why}): write it as "
                        "messages, or leave the backend out of the suite's backends"
                    )
    return None


# -- the profile in a config file ----------------------------------------------------------------------------
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
    doc = tomli.loads(text)
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
        got = json.loads(json.dumps(tomli.loads(new), default=str))
    except tomli.TOMLDecodeError:
        got = None
    if got != expected:
        raise InputError(f"{path}: cannot place [backends.request] for {backend!r} safely; paste it by hand")
    mode = path.stat().st_mode & 0o7777
    tmp = path.with_name(f".{path.name}.doctor")
    tmp.write_text(new, encoding="utf-8", newline="")
    tmp.chmod(mode)
    tmp.replace(path)
