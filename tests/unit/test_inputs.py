"""Config and canary parsing: good files load, bad ones give one line naming file and field."""

from pathlib import Path

import pytest

from canaryd.canaries import Expect, load_suite, load_suites
from canaryd.config import load_config
from canaryd.errors import InputError

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())

GOOD_SUITE = """
[suite]
name = "t"
[defaults]
max_tokens = 8
[[canary]]
id = "a"
messages = [{ role = "user", content = "2+2?" }]
expect = { number = 4 }
[[canary]]
id = "b"
prompt = "Paris is the capital of"
decoding = { max_tokens = 3, top_logprobs = 2 }
expect = { regex = "^france" }
"""

GOOD_CONFIG = """
suites = ["s.toml", { path = "/abs/other.toml", backends = ["v"] }]
[[backends]]
name = "v"
kind = "vllm"
base_url = "http://127.0.0.1:8000/v1/"
model = "m"
[[backends]]
name = "o"
kind = "openai"
base_url = "https://api.example.com/v1"
model = "gpt"
api_key_env = "EXAMPLE_KEY"
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_shipped_default_suite_is_valid_and_covers_the_required_kinds():
    suite = load_suite(REPO / "canaries" / "default.toml")
    assert len(suite.canaries) >= 12
    kinds = {
        k
        for c in suite.canaries
        for k in ("exact", "regex", "choices", "number")
        if getattr(c.expect, k) is not None
    }
    assert {"regex", "choices", "number"} <= kinds
    assert any(c.decoding.max_tokens == 1 for c in suite.canaries)
    assert any(c.decoding.max_tokens >= 64 for c in suite.canaries)
    assert any(c.prompt is not None for c in suite.canaries)
    assert all(c.decoding.temperature == 0 and c.decoding.top_logprobs == 5 for c in suite.canaries)


def test_suite_defaults_merge_under_canary_settings(tmp_path):
    s = load_suite(write(tmp_path, "s.toml", GOOD_SUITE))
    a, b = s.canaries
    assert a.decoding.max_tokens == 8 and a.decoding.top_logprobs == 5 and a.endpoint == "chat"
    assert b.decoding.max_tokens == 3 and b.decoding.top_logprobs == 2 and b.endpoint == "completions"
    assert a.suite == "t" and a.prompt_hash() != b.prompt_hash()


def test_config_resolves_paths_and_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "canaryd.toml", GOOD_CONFIG))
    assert cfg.backends[0].base_url == "http://127.0.0.1:8000/v1"
    assert cfg.suites[0].path == tmp_path / "s.toml" and cfg.suites[0].backends is None
    assert cfg.suites[1].path == Path("/abs/other.toml") and cfg.suites[1].backends == ("v",)
    assert cfg.storage_url.startswith("sqlite:///") and cfg.storage_url.endswith("canaryd.db")


def test_api_key_is_read_from_the_named_environment_variable(tmp_path, monkeypatch):
    cfg = load_config(write(tmp_path, "canaryd.toml", GOOD_CONFIG))
    monkeypatch.delenv("EXAMPLE_KEY", raising=False)
    with pytest.raises(InputError, match="EXAMPLE_KEY is not set"):
        cfg.backend("o").api_key()
    monkeypatch.setenv("EXAMPLE_KEY", "sk-123")
    assert cfg.backend("o").api_key() == "sk-123"
    assert "sk-123" not in cfg.model_dump_json()


def test_api_key_file_relative_to_credentials_directory(tmp_path, monkeypatch):
    (tmp_path / "key").write_text("sk-cred\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    text = GOOD_CONFIG.replace('api_key_env = "EXAMPLE_KEY"', 'api_key_file = "key"')
    assert load_config(write(tmp_path, "c.toml", text)).backend("o").api_key() == "sk-cred"


@pytest.mark.parametrize(
    ("text", "expect", "case", "ok"),
    [
        ("42", {"number": 42}, None, True),
        ("The answer is 42.", {"number": 42}, None, True),
        ("41.9", {"number": 42, "tolerance": 0.2}, None, True),
        ("43", {"number": 42}, None, False),
        ("no number", {"number": 42}, None, False),
        (" Paris ", {"exact": "paris"}, None, True),
        ("Paris", {"exact": "paris", "case_sensitive": True}, None, False),
        ("B)", {"choices": ["B", "B)"]}, None, True),
        ("C", {"choices": ["B", "B)"]}, None, False),
        ("H2O", {"regex": "^H2O$", "case_sensitive": True}, None, True),
        ("h2o", {"regex": "^H2O$", "case_sensitive": True}, None, False),
    ],
)
def test_expected_answer_kinds(text, expect, case, ok):
    assert Expect(**expect).check(text) is ok


BAD_CANARIES = [
    ("invalid TOML", "[suite\nname='x'", "invalid TOML"),
    ("no suite table", "[[canary]]\nid='a'\nprompt='x'", "suite: Field required"),
    ("no canaries", "[suite]\nname='x'", "canary: Field required"),
    ("missing id", "[suite]\nname='x'\n[[canary]]\nprompt='x'", "canary[0].id: Field required"),
    ("bad id", "[suite]\nname='x'\n[[canary]]\nid='a b'\nprompt='x'", "canary[0] (id 'a b').id"),
    (
        "both prompts",
        "[suite]\nname='x'\n[[canary]]\nid='a'\nprompt='x'\nmessages=[{role='user',content='y'}]",
        "exactly one of messages",
    ),
    ("no prompt", "[suite]\nname='x'\n[[canary]]\nid='a'", "exactly one of messages"),
    (
        "bad role",
        "[suite]\nname='x'\n[[canary]]\nid='a'\nmessages=[{role='robot',content='y'}]",
        "messages[0].role",
    ),
    (
        "wrong type",
        "[suite]\nname='x'\n[[canary]]\nid='a'\nprompt='x'\ndecoding={max_tokens='many'}",
        "decoding.max_tokens",
    ),
    (
        "top_logprobs too big",
        "[suite]\nname='x'\n[[canary]]\nid='a'\nprompt='x'\ndecoding={top_logprobs=50}",
        "decoding.top_logprobs",
    ),
    (
        "two expect kinds",
        "[suite]\nname='x'\n[[canary]]\nid='a'\nprompt='x'\nexpect={exact='a',number=1}",
        "give exactly one of exact",
    ),
    ("bad regex", "[suite]\nname='x'\n[[canary]]\nid='a'\nprompt='x'\nexpect={regex='('}", "invalid regex"),
    (
        "unknown field",
        "[suite]\nname='x'\n[[canary]]\nid='a'\nprompt='x'\ntemprature=0",
        "temprature: Extra inputs are not permitted",
    ),
    (
        "duplicate ids",
        "[suite]\nname='x'\n[[canary]]\nid='a'\nprompt='x'\n[[canary]]\nid='a'\nprompt='y'",
        "canary[1] (id 'a').id: duplicate canary id",
    ),
    (
        "negative temperature",
        "[suite]\nname='x'\n[defaults]\ntemperature=-1\n[[canary]]\nid='a'\nprompt='x'",
        "defaults.temperature",
    ),
]


@pytest.mark.parametrize(("name", "text", "message"), BAD_CANARIES, ids=[c[0] for c in BAD_CANARIES])
def test_bad_canary_files_name_file_and_field(tmp_path, name, text, message):
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(InputError) as err:
        load_suite(path)
    line = str(err.value)
    assert line.startswith(str(path)) and message in line and "\n" not in line


def test_duplicate_ids_across_suites(tmp_path):
    one = write(tmp_path, "one.toml", "[suite]\nname='x'\n[[canary]]\nid='a'\nprompt='x'")
    two = write(tmp_path, "two.toml", "[suite]\nname='y'\n[[canary]]\nid='a'\nprompt='y'")
    with pytest.raises(InputError, match=r"already defined in .*one\.toml"):
        load_suites([one, two])


BACKEND = "[[backends]]\nname='v'\nkind='vllm'\nbase_url='http://h:1/v1'\nmodel='m'\n"
BAD_CONFIGS = [
    ("invalid TOML", "suites = [", "invalid TOML"),
    ("no backends", "suites=['s.toml']", "backends: at least one"),
    ("no suites", BACKEND, "suites: at least one"),
    ("unknown kind", BACKEND.replace("vllm", "triton") + "suites=['s']", "backends[0].kind"),
    (
        "missing model",
        BACKEND.replace("model='m'\n", "") + "suites=['s']",
        "backends[0].model: Field required",
    ),
    ("bad url", BACKEND.replace("http://h:1/v1", "h:1") + "suites=['s']", "backends[0].base_url"),
    ("wrong type", "suites=['s']\n" + BACKEND + "concurrency='lots'", "backends[0].concurrency"),
    ("duplicate backend", "suites=['s']\n" + BACKEND + BACKEND, "duplicate backend name 'v'"),
    (
        "unknown backend in suite",
        "suites=[{path='s',backends=['nope']}]\n" + BACKEND,
        "unknown backend 'nope'",
    ),
    (
        "key in both places",
        "suites=['s']\n" + BACKEND + "api_key_env='A'\napi_key_file='f'",
        "at most one of",
    ),
    ("bad env name", "suites=['s']\n" + BACKEND + "api_key_env='1-A'", "backends[0].api_key_env"),
    ("suites after a backend table", BACKEND + "suites=['s']", "backends[0].suites: Extra inputs"),
    ("typo", "sutes=['s']\n" + BACKEND, "sutes: Extra inputs are not permitted"),
    (
        "negative tolerance",
        "suites=['s']\n[compare]\nlogprob_tolerance=-1\n" + BACKEND,
        "compare.logprob_tolerance",
    ),
    ("odd key stays one line", "suites=['s']\n[daemon]\n\"a\\nb\" = 1\n" + BACKEND, 'daemon."a\\nb": Extra'),
    ("dotted key is quoted", "suites=['s']\n[daemon]\n\"x.y\" = 1\n" + BACKEND, 'daemon."x.y": Extra'),
]


@pytest.mark.parametrize(("name", "text", "message"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_configs_name_file_and_field(tmp_path, name, text, message):
    path = write(tmp_path, "canaryd.toml", text)
    with pytest.raises(InputError) as err:
        load_config(path)
    line = str(err.value)
    assert line.startswith(str(path)) and message in line and "\n" not in line


def test_missing_config_file_says_how_to_make_one(tmp_path):
    with pytest.raises(InputError, match="canaryd init"):
        load_config(tmp_path / "nope.toml")


def test_schedules_build_apscheduler_triggers_with_jitter():
    from apscheduler.triggers.cron import CronTrigger
    from apscheduler.triggers.interval import IntervalTrigger

    from canaryd.config import ScheduleConfig
    from canaryd.daemon.service import trigger_for

    cron = trigger_for(ScheduleConfig(cron="*/5 * * * *", jitter="10s"))
    assert isinstance(cron, CronTrigger) and cron.jitter == 10
    every = trigger_for(ScheduleConfig(every="90s", jitter="5s"))
    assert isinstance(every, IntervalTrigger) and every.interval.total_seconds() == 90 and every.jitter == 5
    assert trigger_for(ScheduleConfig()).interval.total_seconds() == 300
