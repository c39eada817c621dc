"""The CLI as a user meets it: exit codes and one-line errors, never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def canaryd(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "canaryd", *args], capture_output=True, text=True, cwd=cwd, timeout=60
    )


def test_version_and_help():
    assert canaryd("--version").stdout.startswith("canaryd 0.1.0")
    h = canaryd("--help")
    assert h.returncode == 0 and "Exit codes" in h.stdout


def test_init_writes_a_config_that_validates(tmp_path):
    p = canaryd("init", str(tmp_path / "canaryd.toml"))
    assert p.returncode == 0, p.stderr
    v = canaryd("-c", str(tmp_path / "canaryd.toml"), "validate")
    assert v.returncode == 0 and "13 canaries" in v.stdout
    again = canaryd("init", str(tmp_path / "canaryd.toml"))
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["check", "--frobnicate"], "No such option"),
        (["nope"], "No such command"),
        (["--log-level", "loud", "validate"], "--log-level: unknown level"),
        (["history", "--limit", "0"], "--limit"),
    ],
)
def test_usage_errors_exit_2(tmp_path, args, message):
    p = canaryd(*args, cwd=tmp_path)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


def test_bad_config_exits_2_with_one_line(tmp_path):
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text("suites = ['s.toml']\n[[backends]]\nname = 'v'\nkind = 'tgi'\n")
    p = canaryd("-c", str(cfg), "check")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and str(cfg) in p.stderr and "backends[0].kind" in p.stderr


def test_unknown_backend_and_missing_suite_exit_2(tmp_path):
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(
        "suites = ['missing.toml']\n[[backends]]\nname='v'\nkind='vllm'\n"
        "base_url='http://127.0.0.1:9/v1'\nmodel='m'\n"
    )
    p = canaryd("-c", str(cfg), "check", "--backend", "w")
    assert p.returncode == 2 and "unknown backend 'w'" in p.stderr
    p = canaryd("-c", str(cfg), "check")
    assert p.returncode == 2 and "missing.toml: cannot read canary file" in p.stderr


def test_missing_api_key_variable_exits_2_before_probing(tmp_path):
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(
        f"suites = ['{REPO / 'canaries/default.toml'}']\nstate_dir = 'state'\n[[backends]]\nname='o'\n"
        "kind='openai'\nbase_url='http://127.0.0.1:9/v1'\nmodel='m'\napi_key_env='CANARYD_NO_SUCH_KEY'\n"
    )
    p = canaryd("-c", str(cfg), "check")
    assert p.returncode == 2 and "CANARYD_NO_SUCH_KEY is not set" in p.stderr
    assert not (tmp_path / "state" / "canaryd.db").exists()


def test_unreadable_database_is_a_storage_error_exit_4(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "canaryd.db").write_text("this is not a database" * 100)
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(
        f"suites = ['{REPO / 'canaries/default.toml'}']\nstate_dir = 'state'\n[[backends]]\nname='v'\n"
        "kind='vllm'\nbase_url='http://127.0.0.1:9/v1'\nmodel='m'\n"
    )
    p = canaryd("-c", str(cfg), "history")
    assert (
        p.returncode == 4 and p.stderr.startswith("canaryd: storage error:") and "Traceback" not in p.stderr
    )
