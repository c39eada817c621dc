"""Canary files: known-answer prompts with pinned decoding settings.

A suite is one TOML file::

    [suite]
    name = "default"

    [defaults]              # optional: decoding settings shared by every canary in the file
    max_tokens = 16

    [[canary]]
    id = "arith-add"
    messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
    expect = { number = 42 }

Every decoding parameter has an explicit value that is always sent, because servers otherwise fill
defaults from files (``generation_config.json``) that can change under you.

A **chained** canary is a plan of ``steps`` sent in order (see ``chain.py``), each with its own ``messages``
or ``prompt`` and optionally a ``decoding`` table whose keys override the canary's. ``{{step_id}}`` in a
step's text (whitespace inside the braces allowed) inserts an earlier step's output; every ``{{...}}`` must
name an earlier step. ``expect`` judges the final step::

    [[canary]]
    id = "plan"
    expect = { choices = ["yes", "no"] }
    [[canary.steps]]
    id = "extract"
    messages = [{ role = "user", content = "List the terms that decide: ..." }]
    [[canary.steps]]
    id = "answer"
    messages = [{ role = "user", content = "Terms: {{ extract }}. Covered? Answer yes or no." }]
    decoding = { max_tokens = 2 }
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Literal, Self

import tomli
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from canaryd.conform import EFFORTS, Conform
from canaryd.errors import InputError, describe_validation_error
from canaryd.files import read_regular
from canaryd.lazy import lazy_import
from canaryd.regexrisk import backtracking_risk
from canaryd.toolcalls import ExpectedCall, Tool, ToolChoice, check_tools

# the `regex` package (a match time bound that releases the GIL), loaded by the first suite that has a regex
rx = lazy_import("regex")

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
_NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)?(?:[eE][-+]?\d+)?")
STEP_REF = re.compile(r"\{\{\s*(.*?)\s*\}\}")  # {{ step_id }} in a chained canary's step
# A regex check that takes longer is cut off (`CheckTimeout`). The ``regex`` package releases the GIL while
# it matches, so even a pattern that backtracks catastrophically never stalls the rest of the process.
CHECK_TIMEOUT_S = 1.0
SUITE_BYTES = 16 << 20  # the default of ``[limits] suite_bytes``


class CheckTimeout(Exception):
    """An expected-answer check ran out of time (a regex that backtracks catastrophically on the answer)."""

    def __init__(self, pattern: str, length: int, timeout_s: float) -> None:
        super().__init__(
            f"regex {pattern!r} took more than {timeout_s:g}s on a {length}-character answer "
            "(it backtracks catastrophically: see `canaryd validate`)"
        )
        self.pattern = pattern


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class Decoding(_Strict):
    temperature: Annotated[float, Field(ge=0, le=2)] = 0.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    max_tokens: Annotated[int, Field(ge=1, le=65536)] = 32  # reasoning models spend thousands unseen
    seed: int | None = 0
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 5
    stop: tuple[str, ...] = ()
    # A sampled canary: n draws per cycle, compared with the baseline's as distributions (sampled.py).
    # Not a request field: sample i is sent with seed + i (or no seed), one request each.
    samples: Annotated[int, Field(ge=1, le=1000)] = 1
    # Sent only when set (OpenAI's reasoning models; a `conform` canary varies it).
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]

    @field_validator("seed", mode="before")
    @classmethod
    def _no_seed(cls, seed: object) -> object:
        """TOML has no null: ``seed = "none"`` sends no seed, so the server draws a fresh one per request."""
        return None if seed == "none" else seed

    @field_validator("samples")
    @classmethod
    def _sampled(cls, samples: int, info: ValidationInfo) -> int:
        if samples > 1 and info.data.get("temperature", 1.0) == 0:
            raise ValueError("samples > 1 needs temperature > 0 (greedy decoding draws one answer n times)")
        return samples


class Expect(_Strict):
    """The known answer. Exactly one of ``exact``, ``regex``, ``choices``, ``number`` or ``tool_call``
    (the function call the answer must make, `canaryd.toolcalls`; judged on the response's tool calls).

    ``answer`` is an optional reference text (shown in reports, and what the demo model is trained to
    say); when given it must pass the check itself, which catches a mistyped pattern early.
    """

    answer: str | None = None
    exact: str | None = None
    regex: str | None = None
    choices: tuple[str, ...] | None = None
    number: float | None = None
    tool_call: ExpectedCall | None = None
    tolerance: Annotated[float, Field(ge=0)] = 0.0
    case_sensitive: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        kinds = ("exact", "regex", "choices", "number", "tool_call")
        given = [k for k in kinds if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(kinds)} (got {given or 'none'})")
        if self.tool_call is not None and self.answer is not None:
            raise ValueError("a tool_call expectation takes no reference answer")
        if self.regex is not None:
            try:
                rx.compile(self.regex)
            except rx.error as e:
                raise ValueError(f"invalid regex: {e}") from None
        if self.choices is not None and not self.choices:
            raise ValueError("choices must not be empty")
        try:
            if self.answer is not None and not self.check(self.answer):
                raise ValueError(f"the reference answer {self.answer!r} does not pass the check")
        except CheckTimeout as e:
            raise ValueError(f"checking the reference answer: {e}") from None
        return self

    def check(self, text: str, timeout_s: float = CHECK_TIMEOUT_S) -> bool:
        """True when ``text`` is the known answer. Surrounding whitespace never matters.

        A regex gets at most ``timeout_s`` (`CheckTimeout` after that).
        """
        answer = text.strip()
        if self.tool_call is not None:  # judged on the structured call (`toolcalls.check_call`), not text
            return False
        if self.number is not None:
            found = _NUMBER.search(answer)
            return found is not None and abs(float(found.group().replace(",", ".")) - self.number) <= (
                self.tolerance
            )
        if self.regex is not None:
            flags = 0 if self.case_sensitive else rx.IGNORECASE
            try:
                return rx.search(self.regex, answer, flags, timeout=timeout_s) is not None
            except TimeoutError:
                raise CheckTimeout(self.regex, len(answer), timeout_s) from None
        fold = (lambda s: s) if self.case_sensitive else str.casefold
        wanted = (self.exact,) if self.exact is not None else self.choices
        return fold(answer) in {fold(w.strip()) for w in wanted or ()}


def _check_one_prompt(messages: tuple[Message, ...] | None, prompt: str | None) -> None:
    if (messages is None) == (prompt is None):
        raise ValueError("give exactly one of messages (chat) or prompt (raw completion)")
    if messages is not None and not messages:
        raise ValueError("messages must not be empty")


class Step(_Strict):
    """One request of a chained canary; ``{{step_id}}`` in its text inserts an earlier step's output."""

    id: Annotated[str, Field(pattern=ID_PATTERN)]
    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    decoding: Decoding | None = None  # only the keys given override the canary's decoding

    @model_validator(mode="after")
    def _one_prompt(self) -> Self:
        _check_one_prompt(self.messages, self.prompt)
        return self

    def references(self) -> list[str]:
        """The step ids its text refers to, in order of appearance."""
        texts = [m.content for m in self.messages] if self.messages is not None else [self.prompt or ""]
        return [ref.group(1) for t in texts for ref in STEP_REF.finditer(t)]


class Canary(_Strict):
    id: Annotated[str, Field(pattern=ID_PATTERN)]
    description: str = ""
    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    steps: tuple[Step, ...] | None = None  # a chained canary: no top-level messages or prompt
    decoding: Decoding = Decoding()
    expect: Expect | None = None
    tools: tuple[Tool, ...] | None = None  # offered to the model (chat only), sent as given
    tool_choice: ToolChoice | None = None
    conform: Conform | None = None  # a parameter-conformance canary: sent twice (`canaryd.conform`)
    # A forced canary: this fixed answer is scored token by token on the prompt (teacher forcing) by a kind
    # that can score (`backends.base.Scorer`); nothing is sampled, so only logprobs and top-k can move.
    continuation: Annotated[str, Field(min_length=1)] | None = None
    tags: tuple[str, ...] = ()
    suite: str = ""

    @field_validator("steps")
    @classmethod
    def _plan(cls, steps: tuple[Step, ...] | None) -> tuple[Step, ...] | None:
        """Unique step ids; every reference names an earlier step (so the plan runs in file order)."""
        if steps is None:
            return None
        if not steps:
            raise ValueError("steps must not be empty")
        earlier: list[str] = []
        for i, step in enumerate(steps):
            if step.id in earlier:
                raise ValueError(
                    f"duplicate step id {step.id!r} (steps[{earlier.index(step.id)}] and steps[{i}])"
                )
            for ref in step.references():
                if ref not in earlier:
                    what = "a later step" if ref in {s.id for s in steps} else "no step"
                    raise ValueError(
                        f"steps[{i}] (id {step.id!r}): {{{{{ref}}}}} names {what} "
                        f"(earlier steps: {', '.join(earlier) or 'none'})"
                    )
            earlier.append(step.id)
        return steps

    @model_validator(mode="after")
    def _one_prompt(self) -> Self:
        if self.steps is None:
            _check_one_prompt(self.messages, self.prompt)
        elif self.messages is not None or self.prompt is not None:
            raise ValueError("a chained canary (steps) takes no top-level messages or prompt")
        elif any(self.step_decoding(s).samples > 1 for s in self.steps):
            raise ValueError("decoding.samples: a chained canary is not sampled (samples must be 1)")
        self._check_contract()
        return self

    def _check_contract(self) -> None:
        """Tools, an expected tool call and a conformance pair: only where they can be sent and judged."""
        check_tools(self.tools, self.tool_choice)
        wants_call = self.expect is not None and self.expect.tool_call is not None
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: only a chat canary (messages, no steps) can offer tools")
        if wants_call and self.tools is None:
            raise ValueError("expect.tool_call needs tools")
        if wants_call and self.expect.tool_call.name not in {t.function.name for t in self.tools or ()}:
            raise ValueError(f"expect.tool_call.name {self.expect.tool_call.name!r} is not in tools")
        if (self.tools is not None or self.conform is not None) and self.decoding.samples > 1:
            raise ValueError("decoding.samples: a tool-call or conform canary is not sampled")
        if self.conform is not None:
            if self.steps is not None:
                raise ValueError("conform: a chained canary cannot be a conformance pair")
            if self.conform.param == "reasoning_effort" and self.messages is None:
                raise ValueError("conform: reasoning_effort needs a chat canary (messages)")
        if self.continuation is not None:
            self._check_forced()

    def _check_forced(self) -> None:
        """A forced canary scores one fixed answer: nothing to chain, sample, call or vary, and no answer of
        its own to check (the continuation is the answer)."""
        for key, given in (
            ("steps", self.steps is not None),
            ("tools", self.tools is not None),
            ("conform", self.conform is not None),
            ("decoding.samples", self.decoding.samples > 1),
            ("expect", self.expect is not None),
        ):
            if given:
                raise ValueError(f"continuation: a forced canary takes no {key} (it scores one fixed answer)")
        if self.decoding.top_logprobs < 1:
            raise ValueError("continuation: a forced canary needs decoding.top_logprobs >= 1")

    def step_decoding(self, step: Step) -> Decoding:
        """The canary's decoding with the keys the step sets overriding it."""
        if step.decoding is None:
            return self.decoding
        return self.decoding.model_copy(
            update={k: getattr(step.decoding, k) for k in step.decoding.model_fields_set}
        )

    def observed_ids(self) -> tuple[str, ...]:
        """The canary ids its observations carry: its own, or ``id:step`` per step of a chain."""
        if self.conform is not None:
            return (f"{self.id}:low", f"{self.id}:high")
        return (self.id,) if self.steps is None else tuple(f"{self.id}:{s.id}" for s in self.steps)

    @property
    def endpoint(self) -> Literal["chat", "completions"]:
        return "chat" if self.messages is not None else "completions"

    def prompt_hash(self) -> str:
        body: object = [m.model_dump() for m in self.messages] if self.messages is not None else self.prompt
        if self.tools is not None:
            body = [body, [t.body() for t in self.tools]]
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


class Suite(_Strict):
    name: str
    path: Path
    canaries: tuple[Canary, ...]


class _SuiteHeader(_Strict):
    name: Annotated[str, Field(pattern=ID_PATTERN)]
    description: str = ""


class _SuiteFile(_Strict):
    suite: _SuiteHeader
    defaults: Decoding | None = None
    canary: Annotated[list[dict], Field(min_length=1)]


def load_suite(path: Path, max_bytes: int = SUITE_BYTES) -> Suite:
    """Parse and validate one canary file; any problem raises `InputError` naming file and field.

    The file must be a regular file of at most ``max_bytes`` (``[limits] suite_bytes``), checked before it
    is read (`canaryd.files.read_regular`).
    """
    try:
        text = read_regular(path, "canary file", limit=max_bytes, limit_key="[limits] suite_bytes")
        if (parsed := _PARSED.get((path, text))) is not None:
            return parsed
        raw = tomli.loads(text)
    except OSError as e:
        raise InputError(f"{path}: cannot read canary file: {e.strerror or e}") from None
    except (tomli.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: invalid TOML: {e}") from None
    try:
        head = _SuiteFile.model_validate(raw)
    except ValidationError as e:
        raise InputError(f"{path}: {describe_validation_error(e)}") from None
    defaults = head.defaults.model_dump() if head.defaults else {}
    canaries: list[Canary] = []
    seen: set[str] = set()
    for i, item in enumerate(head.canary):
        where = f"canary[{i}]" + (f" (id {item['id']!r})" if isinstance(item.get("id"), str) else "")
        try:
            data = {**item, "suite": head.suite.name}
            if isinstance(item.get("decoding", {}), dict):
                data["decoding"] = {**defaults, **item.get("decoding", {})}
            canary = Canary.model_validate(data)
        except ValidationError as e:
            raise InputError(f"{path}: {where}.{describe_validation_error(e)}") from None
        if canary.id in seen:
            raise InputError(f"{path}: {where}.id: duplicate canary id {canary.id!r}")
        seen.add(canary.id)
        canaries.append(canary)
    suite = Suite(name=head.suite.name, path=path, canaries=tuple(canaries))
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    _PARSED[(path, text)] = suite
    return suite


# Suites this process parsed, by path and exact text: the file is read and checked every time, and parsed
# again only when its text changed (a `canaryd check` pass parsed its TOML again each time). Suites are
# frozen, so one object serves every caller.
_PARSED: dict[tuple[Path, str], Suite] = {}
_PARSED_MAX = 64


def load_suites(paths: list[Path], max_bytes: int = SUITE_BYTES) -> list[Suite]:
    """Load several suites; canary ids must be unique across all of them (they key the history)."""
    suites = [load_suite(p, max_bytes) for p in paths]
    owner: dict[str, Path] = {}
    for s in suites:
        for c in s.canaries:
            if c.id in owner:
                raise InputError(f"{s.path}: canary id {c.id!r} already defined in {owner[c.id]}")
            owner[c.id] = s.path
    return suites


def risky_patterns(suites: list[Suite]) -> list[str]:
    """One line per regex that `backtracking_risk` flags, naming file, canary and pattern."""
    lines = []
    for suite in suites:
        for c in suite.canaries:
            pattern = c.expect.regex if c.expect else None
            why = backtracking_risk(pattern) if pattern is not None else None
            if why:
                lines.append(
                    f"{suite.path}: canary {c.id!r}: regex {pattern!r} may backtrack catastrophically "
                    f"({why}); its check is cut off after {CHECK_TIMEOUT_S:g}s (verdict error, check_timeout)"
                )
    return lines
