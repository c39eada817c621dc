"""Tool-call canaries: the schema subset, each failure reason, the canary file's errors, the request sent,
the recorded provider shapes, and the scripted kind's probe pass (baseline, then a regression per failure).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from canaryd.backends import openai_request
from canaryd.backends import openai_wire as wire
from canaryd.canaries import load_suite
from canaryd.errors import InputError
from canaryd.judge.compare import compare
from canaryd.observation import Observation, ToolCall
from canaryd.toolcalls import ExpectedCall, check_call, schema_problem, violation
from tests.harness.fixtures import ROOT, every, read
from tests.harness.scripted_lab import ScriptedLab, by_id, change, scripted, verdicts

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["city"],
    "additionalProperties": False,
}


# -- the schema subset -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"city": "Paris"}, None),
        ({"city": "Paris", "unit": "celsius", "days": 3.0, "tags": ["a"]}, None),  # 3.0 is an integer
        ([], "$: expected object, got array []"),
        ({}, "$: required property 'city' is missing"),
        ({"city": 5}, "$.city: expected string, got integer 5"),
        ({"city": ""}, "$.city: shorter than minLength 1"),
        ({"city": "P", "unit": "kelvin"}, '$.unit: "kelvin" is not one of ["celsius", "fahrenheit"]'),
        ({"city": "P", "days": True}, "$.days: expected integer, got boolean true"),
        ({"city": "P", "days": 2.5}, "$.days: expected integer, got number 2.5"),
        ({"city": "P", "days": 9}, "$.days: 9 > maximum 7"),
        ({"city": "P", "tags": ["a", 1]}, "$.tags[1]: expected string, got integer 1"),
        ({"city": "P", "tags": ["a", "b", "c"]}, "$.tags: more than maxItems 2 items"),
        (
            {"city": "P", "country": "FR"},
            "$: property 'country' is not allowed (additionalProperties is false)",
        ),
    ],
)
def test_violation_names_the_path_and_why(value, why):
    assert violation(WEATHER, value) == why


def test_number_accepts_integers_and_const_and_nested_additional_properties():
    assert violation({"type": "number"}, 3) is None
    assert violation({"const": 1}, 1.0) is None and violation({"const": 1}, True) == "$: true is not 1"
    nested = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert violation(nested, {"a": 1, "b": "x"}) == '$.b: expected integer, got string "x"'
    assert violation({"type": ["string", "null"]}, None) is None
    assert violation(False, 1) == "$: no value is allowed here" and violation(True, {"any": 1}) is None


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (WEATHER, None),
        ({"type": "object", "pattern": "x"}, "$: keyword 'pattern' is not supported"),
        ({"$ref": "#/defs/a"}, "$: keyword '$ref' is not supported"),
        ({"type": "dict"}, "$.type: 'dict' is not one of"),
        ({"type": []}, "$.type: [] is not one of"),
        ({"properties": {"a": {"type": "strin"}}}, "$.properties.a.type: 'strin' is not one of"),
        ({"required": "city"}, "$.required: must be a list of property names"),
        ({"enum": []}, "$.enum: must be a non-empty list"),
        ({"items": 3}, "$.items: a schema is a table (or true/false), not int"),
        ({"maxLength": -1}, "$.maxLength: must be a non-negative integer"),
        ({"minimum": "1"}, "$.minimum: must be a number"),
    ],
)
def test_schema_problem_refuses_what_the_subset_cannot_check(schema, why):
    got = schema_problem(schema)
    assert got == why if why is None else got is not None and got.startswith(why), got


# -- each failure reason ------------------------------------------------------------------------------

EXPECTED = ExpectedCall(name="get_weather", arguments=WEATHER)


@pytest.mark.parametrize(
    ("calls", "why"),
    [
        ((ToolCall("get_weather", '{"city": "Paris"}'),), None),
        (None, "no tool call in the response"),
        ((), "no tool call in the response"),
        (
            (ToolCall("get_time", '{"city": "Paris"}'),),
            "wrong tool name: called 'get_time', expected 'get_weather'",
        ),
        ((ToolCall("get_weather", '{"city": "Par'),), "tool call 'get_weather': arguments are not JSON"),
        (
            (ToolCall("get_weather", '{"city": 7}'),),
            "tool call 'get_weather': arguments break the schema at $.city: expected string, got integer 7",
        ),
    ],
)
def test_each_failure_has_its_own_reason(calls, why):
    got = check_call(EXPECTED, calls)
    assert got == why if why is None else got is not None and got.startswith(why), got


def test_only_the_first_call_is_judged():
    calls = (ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("other", "x"))
    assert check_call(EXPECTED, calls) is None


# -- the canary file ----------------------------------------------------------------------------------

TOOLS = '[{ type = "function", function = { name = "get_weather", parameters = { type = "object" } } }]'
GOOD = """
[suite]
name = "tools"
[[canary]]
id = "weather"
messages = [{{ role = "user", content = "Weather in Paris?" }}]
tools = {tools}
{extra}
expect = {expect}
"""


def suite(tmp_path: Path, tools: str = TOOLS, expect: str = "", extra: str = "") -> Path:
    expect = expect or '{ tool_call = { name = "get_weather", arguments = { required = ["city"] } } }'
    path = tmp_path / "tools.toml"
    path.write_text(GOOD.format(tools=tools, expect=expect, extra=extra))
    return path


def test_a_good_tool_call_canary_loads_and_is_sent_with_its_tools(tmp_path):
    (canary,) = load_suite(suite(tmp_path, extra='tool_choice = "required"')).canaries
    body = openai_request.request_body("m", canary)
    assert body["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert body["tool_choice"] == "required"
    assert hash(canary) == hash(load_suite(suite(tmp_path, extra='tool_choice = "required"')).canaries[0])
    responses = openai_request.responses_body("m", canary)
    assert responses["tools"] == [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    ]


@pytest.mark.parametrize(
    ("kwargs", "wanted"),
    [
        (
            {"expect": '{ tool_call = { name = "get_weather", arguments = { type = "obj" } } }'},
            "canary[0] (id 'weather').expect.tool_call.arguments: schema $.type: 'obj' is not one of",
        ),
        (
            {"expect": '{ tool_call = { name = "get_weather", arguments = { format = "date" } } }'},
            "keyword 'format' is not supported",
        ),
        (
            {"expect": '{ tool_call = { name = "get_time" } }'},
            "expect.tool_call.name 'get_time' is not in tools",
        ),
        ({"tools": "[]"}, "tools must not be empty"),
        ({"tools": TOOLS[:-1] + ", " + TOOLS[1:]}, "tools: duplicate function name 'get_weather'"),
        (
            {"tools": '[{ type = "function", function = { name = "get weather" } }]'},
            "tools[0].function.name: String should match pattern",
        ),
        (
            {"tools": '[{ type = "function", function = { name = "w", parameters = { type = 3 } } }]'},
            "tools[0].function.parameters: schema $.type: 3 is not one of",
        ),
        (
            {"extra": 'tool_choice = { type = "function", function = { name = "nope" } }'},
            "tool_choice names 'nope', which is not in tools",
        ),
        ({"extra": 'tool_choice = "sometimes"'}, "tool_choice"),
        (
            {"expect": '{ tool_call = { name = "get_weather" }, answer = "x" }'},
            "a tool_call expectation takes no reference answer",
        ),
    ],
)
def test_a_bad_schema_or_tools_list_is_one_line_naming_file_and_field(tmp_path, kwargs, wanted):
    path = suite(tmp_path, **kwargs)
    with pytest.raises(InputError) as e:
        load_suite(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: canary[0]"), message
    assert wanted in message, message


def test_tools_need_a_chat_canary_and_an_expected_call_needs_tools(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(
        '[suite]\nname = "t"\n[[canary]]\nid = "x"\nmessages = [{ role = "user", content = "q" }]\n'
        'expect = { tool_call = { name = "f" } }\n'
    )
    with pytest.raises(InputError, match=r"expect\.tool_call needs tools"):
        load_suite(path)
    path.write_text(f'[suite]\nname = "t"\n[[canary]]\nid = "x"\nprompt = "q"\ntools = {TOOLS}\n')
    with pytest.raises(InputError, match="only a chat canary"):
        load_suite(path)


# -- recorded provider shapes -------------------------------------------------------------------------


def fixtures() -> list[Path]:
    found = every("toolcalls")
    assert len(found) >= 4, f"recorded tool-call shapes missing under {ROOT / 'toolcalls'}"
    return found


@pytest.mark.parametrize("path", fixtures(), ids=lambda p: p.stem)
def test_recorded_provider_shapes_parse_to_the_call_they_carry(path):
    doc = read(path)
    assert "https://" in doc["_source"], "every recorded body names where it comes from"
    parse = wire.parse_responses if doc.get("api") == "responses" else wire.parse_chat
    parsed = parse(doc["body"])
    want = doc["expect"]
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c["name"], c["arguments"]) for c in want
    ]
    lines = [line for line in (parsed.text or "").split("\n") if line.startswith(wire.TOOL_CALL_TAG)]
    assert len(lines) == len(want)  # the text carries every call, so the store keeps it


def test_malformed_tool_calls_are_invalid_responses_naming_the_field():
    body = {
        "choices": [{"message": {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}}]
    }
    with pytest.raises(wire.InvalidResponse, match=r"choices.0.message.tool_calls.0.function.name"):
        wire.parse_chat(body)
    body["choices"][0]["message"]["tool_calls"] = "call"
    with pytest.raises(wire.InvalidResponse, match=r"choices\.0\.message\.tool_calls has type str"):
        wire.parse_chat(body)
    body["choices"][0]["message"]["tool_calls"] = [{"function": {"name": "f", "arguments": 3}}]
    with pytest.raises(wire.InvalidResponse, match="arguments has type int"):
        wire.parse_chat(body)


def answer(arguments: str) -> Observation:
    """An answer without logprobs (Anthropic's or Gemini's compatibility) that calls get_weather."""
    o = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "r", has_logprobs=False)
    o.tool_calls = (ToolCall("get_weather", arguments),)
    o.text = wire.with_calls("Sure.", o.tool_calls)
    return o


def test_the_text_carries_the_call_so_a_moved_call_is_drift_even_without_logprobs():
    base = answer('{"city": "Paris"}')
    assert base.text == 'Sure.\n[tool_call] {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
    assert compare(base, answer('{"city": "Paris"}'), correct=True, baseline_correct=True).verdict.value == (
        "identical"
    )
    moved = compare(base, answer('{"city": "Oslo"}'), correct=False, baseline_correct=True)
    assert moved.verdict.value == "regression" and moved.basis == "text"
    assert wire.with_calls(None, None) is None and wire.with_calls("text", ()) == "text"


# -- the scripted kind through the probe pass ---------------------------------------------------------

SCHEMA = (
    '{ type = "object", properties = { city = { enum = ["Paris"] } }, required = ["city"], '
    "additionalProperties = false }"
)
SUITE = f"""
[suite]
name = "tools"
[defaults]
max_tokens = 128
[[canary]]
id = "weather"
messages = [{{ role = "user", content = "What is the weather in Paris?" }}]
tools = {TOOLS}
expect = {{ tool_call = {{ name = "get_weather", arguments = {SCHEMA} }} }}
"""


@pytest.fixture
def lab(tmp_path):
    good = {"weather": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = (
        change(at=2, until=3, tool_call={"name": "get_time", "arguments": '{"city": "Paris"}'})
        + change(at=3, until=4, tool_call={"name": "get_weather", "arguments": '{"city": "Par'})
        + change(at=4, until=5, tool_call={"name": "get_weather", "arguments": '{"city": "Oslo"}'})
        + change(at=5, until=6, no_tool_call=True)
    )
    lab = ScriptedLab(tmp_path, scripted(tool_calls=good, body=body), {"tools.toml": SUITE})
    yield lab
    lab.close()


def test_the_call_is_the_answer_compared_with_its_baseline_and_each_failure_is_a_regression(lab):
    first = by_id(lab.cycle())["weather"]
    assert first.comparison.verdict.value == "baseline" and first.comparison.correct is True
    assert first.observation.tool_calls == (ToolCall("get_weather", '{"city": "Paris"}'),)
    assert first.observation.request["tools"][0]["function"]["name"] == "get_weather"
    stored = lab.store.baseline("fake", "weather").observation
    assert wire.TOOL_CALL_TAG + '{"name": "get_weather"' in stored.text  # the store keeps the call

    wanted = [
        "wrong tool name: called 'get_time', expected 'get_weather'",
        "tool call 'get_weather': arguments are not JSON",
        'tool call \'get_weather\': arguments break the schema at $.city: "Oslo" is not one of ["Paris"]',
        "no tool call in the response",
    ]
    for why in wanted:
        result = by_id(lab.cycle())["weather"]
        assert result.comparison.verdict.value == "regression", result.comparison
        assert result.comparison.correct is False
        assert result.comparison.reasons[0].startswith(why), result.comparison.reasons
    assert verdicts(lab.cycle()) == {"weather": "identical"}  # the good call again
