"""Property-based fuzzing of every parser that reads outside input: config files, canary files and backend
response bodies. Whatever comes in, the only failure is the documented one (`InputError` / `InvalidResponse`
with a one-line message), never a stray exception that would surface as a traceback.
"""

import json
import tomllib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canaryd.backends.openai_wire import InvalidResponse, parse_chat, parse_completion
from canaryd.canaries import load_suite
from canaryd.config import load_config
from canaryd.errors import InputError

SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
toml_scalars = st.one_of(
    st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=20)
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=15,
)


def to_toml(doc: dict) -> str:
    """A tiny TOML writer (inline tables) good enough for fuzzed documents."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v) if v == v and v not in (float("inf"), float("-inf")) else "nan"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"

    return "\n".join(f"{json.dumps(k)} = {value(v)}" for k, v in doc.items())


def _only_input_errors(load, path) -> None:
    try:
        load(path)
    except InputError as e:
        assert "\n" not in str(e) and str(path) in str(e)


suite_like = st.fixed_dictionaries(
    {},
    optional={
        "suite": st.one_of(toml_values, st.fixed_dictionaries({"name": st.text(max_size=12)})),
        "defaults": st.one_of(
            toml_values,
            st.dictionaries(
                st.sampled_from(["temperature", "top_p", "max_tokens", "seed", "top_logprobs", "stop"]),
                toml_scalars,
            ),
        ),
        "canary": st.one_of(
            toml_values,
            st.lists(
                st.dictionaries(
                    st.sampled_from(
                        ["id", "messages", "prompt", "decoding", "expect", "tags", "description"]
                    ),
                    toml_values,
                    max_size=5,
                ),
                max_size=3,
            ),
        ),
    },
)


@SETTINGS
@given(doc=suite_like)
def test_canary_files_fail_only_with_input_errors(tmp_path, doc):
    path = tmp_path / "suite.toml"
    text = to_toml(doc)
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return  # our writer's limits, not canaryd's
    path.write_text(text)
    _only_input_errors(load_suite, path)


@SETTINGS
@given(text=st.text(max_size=200))
def test_arbitrary_text_as_canary_file_or_config(tmp_path, text):
    path = tmp_path / "x.toml"
    path.write_text(text)
    _only_input_errors(load_suite, path)
    _only_input_errors(load_config, path)


config_like = st.fixed_dictionaries(
    {},
    optional={
        "suites": st.one_of(toml_values, st.lists(st.text(max_size=8), max_size=2)),
        "state_dir": toml_values,
        "backends": st.one_of(
            toml_values,
            st.lists(
                st.dictionaries(
                    st.sampled_from(
                        [
                            "name",
                            "kind",
                            "base_url",
                            "model",
                            "api_key_env",
                            "timeout_s",
                            "concurrency",
                            "retries",
                            "engine",
                            "host_probe",
                        ]
                    ),
                    toml_values,
                    max_size=6,
                ),
                max_size=2,
            ),
        ),
        "schedules": st.one_of(
            toml_values,
            st.lists(
                st.dictionaries(
                    st.sampled_from(["name", "every", "cron", "jitter", "backends"]), toml_values, max_size=4
                ),
                max_size=2,
            ),
        ),
        "daemon": toml_values,
        "compare": toml_values,
    },
)


@SETTINGS
@given(doc=config_like)
def test_configs_fail_only_with_input_errors(tmp_path, doc):
    path = tmp_path / "canaryd.toml"
    text = to_toml(doc)
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return
    path.write_text(text)
    _only_input_errors(load_config, path)


logprob_item = st.fixed_dictionaries(
    {},
    optional={
        "token": json_values,
        "logprob": json_values,
        "bytes": json_values,
        "top_logprobs": json_values,
    },
)
chat_like = st.fixed_dictionaries(
    {},
    optional={
        "choices": st.one_of(
            json_values,
            st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "message": st.one_of(
                            json_values, st.fixed_dictionaries({}, optional={"content": json_values})
                        ),
                        "logprobs": st.one_of(
                            json_values,
                            st.fixed_dictionaries(
                                {},
                                optional={
                                    "content": st.one_of(json_values, st.lists(logprob_item, max_size=3))
                                },
                            ),
                        ),
                        "token_ids": json_values,
                        "text": json_values,
                        "finish_reason": json_values,
                    },
                ),
                max_size=2,
            ),
        ),
        "usage": json_values,
        "system_fingerprint": json_values,
    },
)


@SETTINGS
@given(body=st.one_of(json_values, chat_like))
def test_response_parsers_fail_only_with_invalid_response(body):
    for parse in (parse_chat, parse_completion):
        try:
            r = parse(body)
        except InvalidResponse as e:
            assert "\n" not in str(e)
        else:
            assert r.text is None or isinstance(r.text, str)
            assert r.tokens is None or all(isinstance(t.logprob, float) for t in r.tokens)
