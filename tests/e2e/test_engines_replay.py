"""SGLang, TGI and Ollama, replayed from recorded real bodies (tests/harness/engines.py), through the real
``canaryd`` CLI, its config and SQLite history: a baseline, ``identical`` after an unchanged restart (SGLang
draws a new random seed, Ollama a new unload time), then a change scripted in each engine (SGLang restarted
with another ``--dtype``, TGI serving other weights under the same model id, Ollama's model re-pulled to
another digest), each caught and named first by ``explain``.

One replay server and one config with the three backends for the module: three ``check`` runs through the
CLI, ``explain`` read in-process from the same history (what the command prints is that document).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.engines import EngineReplay
from tests.harness.suites import ADD, ANSWERS, CAPITAL, GREEDY, suite

SUITE = suite("engines", GREEDY, ADD, CAPITAL)
MODELS = {"sglang": "qwen/qwen2.5-0.5b-instruct", "tgi": "tgi", "ollama": "llama3"}
NEW_SHA = "1b4a2d6e0c5f7a9b8d3e2f1a0b9c8d7e6f5a4b3c"
NEW_DIGEST = "365c0bd3c000a25d28ddbf732fe1c6add414de7275464c4e4d1c3b5fcb5d8ad1"
SECRET = "sk-sglang-live-5f2a9c"  # as if SGLang had been started with --api-key / --admin-api-key


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    (root / "engines.toml").write_text(SUITE)
    with EngineReplay(ANSWERS) as replay:
        blocks = "".join(
            f'\n[[backends]]\nname = "{e}"\nkind = "{e}"\nbase_url = "{replay.base(e)}"\n'
            f'model = "{m}"\nretries = 0\n'
            for e, m in MODELS.items()
        )
        cfg = root / "canaryd.toml"
        cfg.write_text(f'state_dir = "state"\nsuites = ["engines.toml"]\n{blocks}')
        yield replay, cfg


def cli(cfg: Path, *args: str) -> tuple[int, dict]:
    p = subprocess.run(
        [sys.executable, "-m", "canaryd", "-c", str(cfg), *args, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
        timeout=120,
    )
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, json.loads(p.stdout)


def verdicts(doc: dict) -> dict[tuple[str, str], str]:
    return {(r["backend"], r["canary"]): r["verdict"] for r in doc["results"]}


def test_baseline_restart_and_a_change_in_each_engine(bed) -> None:
    replay, cfg = bed
    replay.edit("sglang", "GET", "/get_server_info", api_key=SECRET, admin_api_key=SECRET)
    code, doc = cli(cfg, "check")
    assert code == 0, doc
    assert set(verdicts(doc).values()) == {"baseline"} and len(doc["results"]) == 6
    assert all(r["correct"] and r["error"] is None for r in doc["results"])
    # each snapshot read the engine's own endpoints (SGLang's old name after a 404 on the new one)
    assert {"/server_info", "/get_server_info", "/get_model_info"} <= set(replay.paths("sglang"))
    assert "/info" in replay.paths("tgi")
    assert {"/api/version", "/api/tags", "/api/show", "/api/ps"} <= set(replay.paths("ollama"))

    replay.restart()
    code, doc = cli(cfg, "check")
    assert code == 0, doc
    assert set(verdicts(doc).values()) == {"identical"}

    # --dtype bfloat16 halves the kv-cache's bytes per token: SGLang's pool holds twice the tokens
    replay.edit("sglang", "GET", "/get_server_info", dtype="bfloat16", max_total_num_tokens=40960)
    replay.edit("tgi", "GET", "/info", model_sha=NEW_SHA)
    with replay._lock:
        replay.body("ollama", "GET", "/api/tags")["models"][1]["digest"] = NEW_DIGEST
    code, doc = cli(cfg, "check")
    assert code == 1, doc
    assert "identical" not in set(verdicts(doc).values())

    from canaryd.commands import reader_of
    from canaryd.config import load_config
    from canaryd.report.record import explain

    first = {
        "sglang": ("engine.dtype", "bfloat16"),
        "tgi": ("model.sha", NEW_SHA),
        "ollama": ("model.digest", NEW_DIGEST),
    }
    with reader_of(load_config(cfg)) as store:
        for engine, (field, value) in first.items():
            stack = explain(store, engine)["stack"]
            assert stack["stack_changes"][0] == {
                "field": field,
                "from": stack["stack_changes"][0]["from"],
                "to": value,
            }
            assert field in stack["suggestion"], stack
