"""Tool-call canaries: the tools a canary offers, the call it expects, and the JSON-schema subset both use.

A canary that offers ``tools`` (OpenAI's function-tool shape) and expects a call::

    [[canary]]
    id = "tool-weather"
    messages = [{ role = "user", content = "What is the weather in Paris?" }]
    tools = [{ type = "function", function = { name = "get_weather", parameters = { type = "object",
              properties = { city = { type = "string" } }, required = ["city"] } } }]
    expect = { tool_call = { name = "get_weather", arguments = { type = "object",
              properties = { city = { enum = ["Paris"] } }, required = ["city"] } } }

The answer is correct when the response carries a tool call, its name is ``name`` and its arguments parse
as JSON and validate against ``arguments``; each failure has its own reason (`check_call`).

Schemas are checked with a small validator of our own, not the ``jsonschema`` package (not a dependency of
canaryd): the subset tool definitions use in practice, ``type`` (one or a list), ``properties``,
``required``, ``enum``, ``const``, ``items``, ``additionalProperties`` (a boolean or a schema),
``minimum``/``maximum``, ``minLength``/``maxLength``, ``minItems``/``maxItems`` and
``description``/``title``/``default``/``examples``, which are annotations. Any other keyword is refused when
the canary file is loaded (`schema_problem`), so a schema never silently checks less than it says.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from canaryd.observation import ToolCall

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's rule for function names
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment"})
_NUMERIC = ("minimum", "maximum")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
KEYWORDS = frozenset(
    {"type", "properties", "required", "enum", "const", "items", "additionalProperties"}
    | set(_NUMERIC)
    | set(_COUNTS)
    | _ANNOTATIONS
)
MAX_DEPTH = 32


def schema_problem(schema: Any, at: str = "$") -> str | None:
    """Why ``schema`` is not a schema of the supported subset (None: it is), naming the path within it."""
    if at.count(".") + at.count("[") > MAX_DEPTH:
        return f"{at}: nested deeper than {MAX_DEPTH} levels"
    if isinstance(schema, bool):
        return None  # true accepts anything, false nothing
    if not isinstance(schema, dict):
        return f"{at}: a schema is a table (or true/false), not {type(schema).__name__}"
    if unknown := sorted(set(schema) - KEYWORDS):
        return (
            f"{at}: keyword {unknown[0]!r} is not supported (supported: "
            f"{', '.join(sorted(KEYWORDS - _ANNOTATIONS))})"
        )
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in TYPES for k in kinds) or (isinstance(kind, list) and not kind):
        return f"{at}.type: {kind!r} is not one of {', '.join(TYPES)} (or a list of them)"
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return f"{at}.properties: must be a table of schemas"
    for name, sub in props.items():
        if (why := schema_problem(sub, f"{at}.properties.{name}")) is not None:
            return why
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{at}.required: must be a list of property names"
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        return f"{at}.enum: must be a non-empty list"
    for key in ("items", "additionalProperties"):
        if key in schema and (why := schema_problem(schema[key], f"{at}.{key}")) is not None:
            return why
    for key in _NUMERIC:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int | float)):
            return f"{at}.{key}: must be a number"
    for key in _COUNTS:
        value = schema.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{at}.{key}: must be a non-negative integer"
    return None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    return {dict: "object", list: "array", str: "string"}.get(type(value), type(value).__name__)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and 1.0 are equal, true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def violation(schema: Any, value: Any, at: str = "$") -> str | None:
    """The first place ``value`` breaks ``schema`` (a schema `schema_problem` accepts), as ``path: why``;
    None when it validates."""
    if schema is True or schema == {}:
        return None
    if schema is False:
        return f"{at}: no value is allowed here"
    kind = schema.get("type")
    if kind is not None:
        allowed = kind if isinstance(kind, list) else [kind]
        got = _type_of(value)
        if got not in allowed and not (got == "integer" and "number" in allowed):
            return f"{at}: expected {' or '.join(allowed)}, got {got} {_show(value)}"
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return f"{at}: {_show(value)} is not one of {_show(schema['enum'])}"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{at}: {_show(value)} is not {_show(schema['const'])}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{at}: {value} < minimum {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{at}: {value} > maximum {schema['maximum']}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{at}: shorter than minLength {schema['minLength']}"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"{at}: longer than maxLength {schema['maxLength']}"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            return f"{at}: fewer than minItems {schema['minItems']} items"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            return f"{at}: more than maxItems {schema['maxItems']} items"
        if "items" in schema:
            for i, item in enumerate(value):
                if (why := violation(schema["items"], item, f"{at}[{i}]")) is not None:
                    return why
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                return f"{at}: required property {name!r} is missing"
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = props.get(name, extra)
            if sub is False:
                return f"{at}: property {name!r} is not allowed (additionalProperties is false)"
            if (why := violation(sub, item, f"{at}.{name}")) is not None:
                return why
    return None


def _show(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_call(expected: ExpectedCall, calls: Sequence[ToolCall] | None) -> str | None:
    """Why the response's tool calls are not the expected one (None: the first call is it).

    Each failure has its own reason: no tool call, the wrong function, arguments that are not JSON, or
    arguments that break the schema (naming the path). Only the first call is judged: a canary asks for one.
    """
    if not calls:
        return "no tool call in the response"
    call = calls[0]
    if call.name != expected.name:
        return f"wrong tool name: called {call.name!r}, expected {expected.name!r}"
    try:
        arguments = json.loads(call.arguments)
    except (TypeError, ValueError, RecursionError):
        return f"tool call {call.name!r}: arguments are not JSON ({_show(call.arguments)})"
    if (why := violation(expected.arguments, arguments)) is not None:
        return f"tool call {call.name!r}: arguments break the schema at {why}"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _checked_schema(schema: Any) -> Any:
    """A schema checked against the subset; TOML gives tables, which stay plain dicts (JSON-dumpable)."""
    if (why := schema_problem(schema)) is not None:
        raise ValueError(f"schema {why}")
    return schema


class ExpectedCall(_Strict):
    """``expect.tool_call``: the function the model must call, and a schema its arguments must pass."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    arguments: Any = True  # a schema of the supported subset; true: any JSON value

    @field_validator("arguments")
    @classmethod
    def _schema(cls, schema: Any) -> Any:
        return _checked_schema(schema)

    def __hash__(self) -> int:  # the schema is a dict: hash its canonical JSON (canaries are hashable)
        return hash((self.name, json.dumps(self.arguments, sort_keys=True)))


class Function(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str = ""
    parameters: Any = None  # a schema of the supported subset (OpenAI: an object schema)

    @field_validator("parameters")
    @classmethod
    def _schema(cls, schema: Any) -> Any:
        return None if schema is None else _checked_schema(schema)

    def __hash__(self) -> int:
        return hash((self.name, self.description, json.dumps(self.parameters, sort_keys=True)))

    def body(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        if self.parameters is not None:
            out["parameters"] = self.parameters
        return out


class Tool(_Strict):
    """One entry of ``tools``: OpenAI's function tool."""

    type: Literal["function"] = "function"
    function: Function

    def body(self) -> dict:
        return {"type": self.type, "function": self.function.body()}


class NamedChoice(_Strict):
    type: Literal["function"] = "function"
    function: dict[str, str]  # {name = "..."}

    @model_validator(mode="after")
    def _named(self) -> Self:
        if set(self.function) != {"name"}:
            raise ValueError("tool_choice.function takes exactly a name")
        return self

    def __hash__(self) -> int:
        return hash(self.function["name"])


ToolChoice = Literal["auto", "required", "none"] | NamedChoice


def check_tools(tools: tuple[Tool, ...] | None, choice: ToolChoice | None) -> None:
    """Tool names unique and non-empty; a named ``tool_choice`` names an offered tool (ValueError)."""
    if tools is None:
        if choice is not None:
            raise ValueError("tool_choice needs tools")
        return
    if not tools:
        raise ValueError("tools must not be empty")
    names = [t.function.name for t in tools]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"tools: duplicate function name {dup[0]!r}")
    if isinstance(choice, NamedChoice) and choice.function["name"] not in names:
        raise ValueError(f"tool_choice names {choice.function['name']!r}, which is not in tools")


def choice_body(choice: ToolChoice) -> str | dict:
    return choice if isinstance(choice, str) else {"type": "function", "function": dict(choice.function)}
