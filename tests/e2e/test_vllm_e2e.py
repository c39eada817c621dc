"""End to end against a real vLLM (CPU) server serving a tiny model: the gate's exit codes and verdicts,
with the default config (learning on, no calibration step: first contact finds the engine exact).

The steps run in order on one history, like an operator's week: server down, baseline, unchanged
restart, weights silently swapped (int8 round trip), dtype silently changed, baseline accepted.
Each server start costs about 40 s, so the module keeps to four.
"""

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from canaryd.lab.vllm_process import VLLMServer
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm
KEY = "sk-canaryd-e2e-4f1c9b2a77"  # recognisable, so the test can prove it is stored nowhere

SUITE = """
[suite]
name = "e2e"
[defaults]
max_tokens = 12
[[canary]]
id = "chat-add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
expect = { number = 42 }
[[canary]]
id = "chat-capital"
messages = [{ role = "system", content = "Be brief." }, { role = "user", content = "Capital of France?" }]
[[canary]]
id = "chat-long"
messages = [{ role = "user", content = "Count from 1 to 10." }]
decoding = { max_tokens = 32 }
[[canary]]
id = "raw-completion"
prompt = "The three primary colors of light are"
decoding = { max_tokens = 8 }
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "local"
kind = "vllm"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
api_key_env = "CANARYD_E2E_KEY"
timeout_s = 30
[[backends]]
name = "compat"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
api_key_env = "CANARYD_E2E_KEY"
timeout_s = 30
"""


class KeyedLab(Lab):
    """The backends authenticate with KEY (from the environment), unless a test passes another key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, SUITE, CONFIG, env={"CANARYD_E2E_KEY": KEY})

    def serve(self, model: Path, dtype: str = "float32") -> VLLMServer:
        return super().serve(model, dtype, api_key=KEY)

    def cli(self, *args: str, key: str = KEY) -> subprocess.CompletedProcess:
        return super().cli(*args, env={"CANARYD_E2E_KEY": key})

    def check(self, *args: str) -> tuple[int, dict]:
        return self.json("check", *args)

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.root / "state" / "canaryd.db")


def verdicts(report: dict, backend: str | None = None) -> dict[str, str]:
    return {r["canary"]: r["verdict"] for r in report["results"] if backend in (None, r["backend"])}


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> KeyedLab:
    return KeyedLab(tmp_path_factory.mktemp("e2e"))


def test_server_down_exits_3_and_records_errors_not_baselines(lab):
    code, report = lab.check()
    assert code == 3
    assert set(verdicts(report).values()) == {"error"}
    assert {r["error_kind"] for r in report["results"]} == {"connect"}
    p = lab.cli("check")
    assert p.returncode == 3 and "backend 'local'" in p.stderr and "Traceback" not in p.stderr
    db = lab.db()
    assert db.execute("select count(*) from baseline").fetchone()[0] == 0
    assert db.execute("select count(*) from observation where verdict = 'error'").fetchone()[0] == 16


def test_baseline_then_unchanged_probe_is_identical(lab, tiny_model):
    with lab.serve(tiny_model):
        first = lab.cli("probe", "--json")
        assert first.returncode == 0, first.stderr
        assert set(verdicts(json.loads(first.stdout)).values()) == {"baseline"}
        # the default config learns; first contact finds vLLM on CPU exact: an exact model for every canary
        # of both backends at once, no learning window
        regimes = lab.db().execute("select backend, canary_id, regime from calibration").fetchall()
        assert len(regimes) == 8 and {r for _, _, r in regimes} == {"exact"}, regimes
        code, report = lab.check()
        assert code == 0, report
        assert set(verdicts(report).values()) == {"identical"}
        # a wrong key is refused by the server: an auth error, exit 3, never a drift verdict
        p = lab.cli("--log-level", "debug", "check", "--json", "--backend", "compat", key="sk-wrong-0d6c1e")
        assert p.returncode == 3
        assert {r["error_kind"] for r in json.loads(p.stdout)["results"]} == {"auth"}
        debug = lab.cli("--log-level", "debug", "check", "--backend", "compat")
        for out in (p.stdout, p.stderr, debug.stdout, debug.stderr):
            assert KEY not in out and "sk-wrong-0d6c1e" not in out

    rows = (
        lab.db()
        .execute(
            "select o.system_fingerprint, o.prompt_tokens, o.completion_tokens, o.text, s.fields, "
            "length(p.data) from observation o join stack s on s.hash = o.stack_hash "
            "join payload p on p.hash = o.payload_hash "
            "where o.backend = 'local' and o.canary_id = 'chat-add'"
        )
        .fetchall()
    )
    fingerprint, prompt_tokens, completion_tokens, text, fields, payload = rows[0]
    stack = json.loads(fields)
    assert fingerprint.startswith("vllm-0.32.0-")
    assert prompt_tokens > 10 and completion_tokens == 12 and text
    assert stack["vllm.version"] == "0.32.0" and stack["models.max_model_len"] == "512"
    assert stack["metrics.vllm:cache_config_info.cache_dtype"] == "auto"
    assert stack["response.system_fingerprint"] == fingerprint and len(stack["template.tokens_sha256"]) == 16
    assert payload > 0


def test_unchanged_restart_raises_no_alarm(lab, tiny_model):
    with lab.serve(tiny_model):
        code, report = lab.check()
    assert code == 0 and set(verdicts(report).values()) == {"identical"}


def test_int8_round_trip_of_the_weights_is_detected(lab, int8_model):
    with lab.serve(int8_model):  # same path, same name, same dtype: only the numbers moved
        code, report = lab.check()
    assert code == 1
    for backend in ("local", "compat"):
        v = verdicts(report, backend)
        assert set(v.values()) <= {"logprob-drift", "answer-drift"}, v


def test_bf16_restart_is_detected_and_the_fingerprint_diff_names_it(lab, tiny_model):
    with lab.serve(tiny_model, dtype="bfloat16"):
        code, report = lab.check()
        assert code == 1
        local = [r for r in report["results"] if r["backend"] == "local"]
        assert all(r["verdict"] in ("logprob-drift", "answer-drift") for r in local), local
        # caught on its first probe by the exact model first contact learned (no calibrate step)
        assert {r["evidence"]["method"] for r in local} == {"exact"}, local
        assert all(r["fingerprint_changed"] for r in local)
        changed = {c["field"] for r in local for c in r["stack_changes"]}
        assert "response.system_fingerprint" in changed
        assert all(r["verdict"] != "identical" for r in report["results"] if r["backend"] == "compat")

        human = lab.cli("check")
        assert human.returncode == 1 and "response.system_fingerprint" in human.stdout

        accept = lab.cli("baseline", "accept")
        assert accept.returncode == 0 and accept.stdout.count("baseline is now") == 8
        code, report = lab.check()
        assert code == 0 and set(verdicts(report).values()) == {"identical"}


def test_history_and_stack_commands_show_what_is_stored(lab):
    h = lab.cli("history", "--backend", "local", "--canary", "chat-add", "--json")
    assert h.returncode == 0
    seq = [r["verdict"] for r in reversed(json.loads(h.stdout)["observations"])]  # oldest first
    drift = {"logprob-drift", "answer-drift"}
    assert seq[:5] == ["error", "error", "baseline", "identical", "identical"]
    assert set(seq[5:8]) <= drift and seq[8:] == ["identical"]
    s = lab.cli("stack", "--backend", "local")
    assert s.returncode == 0 and "response.system_fingerprint:" in s.stdout


def test_the_api_key_is_stored_nowhere(lab):
    blob = b"".join(p.read_bytes() for p in (lab.root / "state").iterdir())
    assert KEY.encode() not in blob
    runs = [str(r) for (r,) in lab.db().execute("select distinct run_id from observation")]
    export = lab.cli("export", *[a for r in runs for a in ("--run", r)])
    assert export.returncode == 0 and len(export.stdout.splitlines()) >= 40
    assert KEY not in export.stdout and KEY not in export.stderr
