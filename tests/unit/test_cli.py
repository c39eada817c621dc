"""The CLI as a user meets it: exit codes and one-line errors, never a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.scripted_lab import PLAIN, ScriptedLab, change, scripted

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
    cfg.write_text("suites = ['s.toml']\n[[backends]]\nname = 'v'\nkind = 'triton'\n")
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


# -- help: every word the source wrote reaches the reader ---------------------------------------------------


def _commands(group, path=()):
    """Every command path of the click tree, the root included."""
    yield path
    for name, cmd in getattr(group, "commands", {}).items():
        yield from _commands(cmd, (*path, name))


def test_every_help_shows_every_word_and_no_flag_takes_a_value():
    from typer.main import get_command
    from typer.testing import CliRunner

    from canaryd.cli import app

    root = get_command(app)
    runner = CliRunner()
    paths = list(_commands(root))
    assert len(paths) > 20
    for path in paths:
        shown = runner.invoke(app, [*path, "--help"], prog_name="canaryd", terminal_width=80).output
        squeezed = "".join(shown.split())
        cmd = root
        for name in path:
            cmd = cmd.commands[name]
        where = f"canaryd {' '.join(path)} --help"
        for p in cmd.params:
            if getattr(p, "help", None):  # the help as written, whatever the wrapping
                assert "".join(p.help.split()) in squeezed, f"{where}: {p.name}: {p.help!r} lost:\n{shown}"
            if getattr(p, "is_flag", False):
                assert f"{p.opts[0]} <" not in shown, f"{where}: the flag {p.opts[0]} shows a value"
        if cmd.help:
            assert "".join(cmd.help.split()) in squeezed, f"{where}: the description lost words"
        for name, sub in getattr(cmd, "commands", {}).items():  # a summary per command, never cut with ...
            assert "".join(sub.get_short_help_str(10_000).split()) in squeezed, f"{where}: {name} cut"
        assert "<bool>" not in shown and "()" not in shown and "( " not in shown, f"{where}:\n{shown}"
        assert shown.count("[") == shown.count("]"), f"{where}: unbalanced brackets:\n{shown}"
    top = runner.invoke(app, ["--help"], prog_name="canaryd").output
    assert "[default: warning; info for run]" in " ".join(top.split())


def test_a_command_parsed_with_its_module_alone_reads_as_in_the_whole_app():
    """`main` parses a command line with an app of the command's module alone (`_app_for`): each command
    there has the help, options and exit codes it has in the whole app; anything else gets the whole app."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from canaryd.cli import MODULES, _app_for, app

    root = get_command(app)
    runner = CliRunner()
    paths = [p for p in _commands(root) if p]
    for path in paths:
        slim = _app_for(path[0])
        assert slim is not app and path[0] in get_command(slim).commands
        for args in ([*path, "--help"], [*path, "--no-such-option"]):
            whole, alone = (
                runner.invoke(a, args, prog_name="canaryd", terminal_width=80) for a in (app, slim)
            )
            assert (alone.exit_code, alone.output) == (whole.exit_code, whole.output), " ".join(args)
    assert len({tuple(get_command(_app_for(p[0])).commands) for p in paths}) == len(MODULES)
    assert _app_for(None) is app and _app_for("no-such-command") is app
    # a --help before the command asks for canaryd's help: the whole app's, with every command
    whole = canaryd("--help")
    assert whole.returncode == 0 and "baseline" in whole.stdout and "validate" in whole.stdout
    assert canaryd("--help", "validate").stdout == whole.stdout


# -- global options before or after the command; init into a directory ---------------------------------------


def test_config_option_before_or_after_the_command(tmp_path):
    assert canaryd("init", str(tmp_path)).returncode == 0
    cfg = str(tmp_path / "canaryd.toml")
    for args in (["-c", cfg, "validate"], ["validate", "-c", cfg], ["validate", f"--config={cfg}"]):
        p = canaryd(*args, cwd=tmp_path.parent)
        assert p.returncode == 0 and "13 canaries" in p.stdout, (args, p.stderr)


def test_global_options_move_in_front_but_never_out_of_a_benchmark_command():
    from canaryd.argv import hoist_global_options as hoist

    assert hoist(["history", "-c", "a.toml", "--limit", "3"]) == ["-c", "a.toml", "history", "--limit", "3"]
    assert hoist(["db", "current", "--config=a.toml"]) == ["--config=a.toml", "db", "current"]
    assert hoist(["--log-level", "info", "validate"]) == ["--log-level", "info", "validate"]
    pre = ["preflight", "--pin", "p", "-c", "a.toml", "--", "bench", "-c", "b"]
    assert hoist(pre, ("preflight",)) == ["-c", "a.toml", "preflight", "--pin", "p", "--", "bench", "-c", "b"]
    bare = ["preflight", "--pin", "p", "bench", "-c", "b"]
    assert hoist(bare, ("preflight",)) == bare


def test_init_into_an_existing_directory_refuses_only_to_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    p = canaryd("init", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {
        "exit_code": 0,
        "written": [str(tmp_path / "canaryd.toml"), str(tmp_path / "canaries" / "default.toml")],
    }
    (tmp_path / "canaryd.toml").write_text("# edited\n")
    again = canaryd("init", str(tmp_path))
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert str(tmp_path / "canaryd.toml") in again.stderr and "already exists" in again.stderr
    assert (tmp_path / "canaryd.toml").read_text() == "# edited\n"  # untouched
    assert canaryd("init", str(tmp_path), "--force").returncode == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"


# -- read-only commands never create or migrate a database --------------------------------------------------

READERS = [
    ["history"],
    ["stack"],
    ["diff", "1", "2"],
    ["explain", "fake"],
    ["record", "--run", "1"],
    ["export", "--run", "1"],
    ["db", "current"],
    ["prune", "--older-than", "1d", "--dry-run"],
]


@pytest.mark.parametrize("args", READERS, ids=lambda a: a[0])
def test_a_reader_never_creates_a_missing_database(tmp_path, args):
    missing = tmp_path / "nonexistent" / "dir"
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(f'suites = ["plain.toml"]\n[storage]\nurl = "sqlite:///{missing}/x.db"\n{scripted()}')
    p = canaryd("-c", str(cfg), *args)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "storage.url" in p.stderr and "no history database" in p.stderr
    assert not (tmp_path / "nonexistent").exists()


def test_a_reader_names_the_state_dir_it_found_no_database_in(tmp_path):
    (tmp_path / "plain.toml").write_text(PLAIN)
    (tmp_path / "file").write_text("not a directory")
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(f'state_dir = "file/state"\nsuites = ["plain.toml"]\n{scripted()}')
    p = canaryd("-c", str(cfg), "history")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"state_dir {tmp_path / 'file' / 'state'}: no history database" in p.stderr


def test_a_reader_never_migrates_an_older_schema(tmp_path):
    from canaryd.store.engine import SCHEMA_REVISION, revision
    from tests.unit.test_migrations import upgrade_to

    url = f"sqlite:///{tmp_path / 'canaryd.db'}"
    upgrade_to(url, "0002")
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(f'suites = ["plain.toml"]\n[storage]\nurl = "{url}"\n{scripted()}')
    for args in (["history"], ["stack", "--json"]):
        p = canaryd("-c", str(cfg), *args)
        assert p.returncode == 4 and p.stderr.startswith("canaryd: storage error:"), p.stderr
        assert "0002" in p.stderr and "canaryd db upgrade" in p.stderr
    current = canaryd("-c", str(cfg), "db", "current", "--json")
    assert json.loads(current.stdout) == {
        "exit_code": 0,
        "revision": "0002",
        "head": SCHEMA_REVISION,
        "state": "behind",
    }
    assert revision(url) == "0002"


# -- one --json envelope; plain tables and no progress when piped -------------------------------------------


def test_every_command_that_prints_has_one_json_envelope(tmp_path):
    lab = ScriptedLab(tmp_path, scripted())
    lab.close()
    runs = [
        ["validate", "--json"],
        ["check", "--json"],
        ["probe", "--json"],
        ["history", "--json"],
        ["stack", "--json"],
        ["explain", "fake", "--json"],
        ["diff", "1", "2", "--json"],
        ["census", "-n", "2", "--batch-sizes", "1,2", "--json"],
        ["baseline", "accept", "--json"],
        ["baseline", "calibrate", "-k", "2", "--json"],
        ["prune", "--older-than", "30d", "--dry-run", "--json"],
        ["db", "current", "--json"],
        ["db", "upgrade", "--json"],
        ["history", "--backend", "nope", "--json", "--limit", "0"],  # a usage error: no envelope (click's)
        ["baseline", "accept", "--backend", "nope", "--json"],  # an InputError: the envelope says why
    ]
    for args in runs:
        p = lab.cli(*args)
        if "--limit" in args:
            assert p.returncode == 2 and p.stdout == ""
            continue
        doc = json.loads(p.stdout)
        assert isinstance(doc, dict) and doc["exit_code"] == p.returncode, (args, p.stdout, p.stderr)
        assert "\r" not in p.stderr, args  # no progress line when piped
    history = json.loads(lab.cli("history", "--json").stdout)
    assert {o["canary_id"] for o in history["observations"]} == {"add", "capital", "colors"}
    bad = json.loads(lab.cli("baseline", "accept", "--backend", "nope", "--json").stdout)
    assert bad["exit_code"] == 2 and "nope" in bad["error"]


def test_piped_tables_are_plain_and_keep_whole_lines(tmp_path):
    lab = ScriptedLab(tmp_path, scripted())
    lab.close()
    p = lab.cli("check")
    assert p.returncode == 0, p.stderr
    assert not set("┃━│─┏┡└╇") & set(p.stdout), p.stdout
    rows = [line.split() for line in p.stdout.splitlines()]
    assert rows[1][:3] == ["backend", "canary", "verdict"]
    assert {r[1] for r in rows[2:-1]} == {"add", "capital", "colors"}
    assert rows[-1][:4] == ["fake:", "1", "serving", "configuration"]  # the run's configurations
    assert "\r" not in p.stderr


def test_the_envelope_carries_the_commands_own_exit_code_on_drift(tmp_path):
    body = change(at=2, canaries=["add"], text="43")
    lab = ScriptedLab(tmp_path, scripted(cycle_file=tmp_path / "cycles", body=body))
    lab.close()
    assert lab.cli("check").returncode == 0  # cycle 1: the baselines
    for args, code in ((["probe", "--json"], 0), (["check", "--json"], 1)):  # probe records drift, exits 0
        p = lab.cli(*args)
        doc = json.loads(p.stdout)
        assert p.returncode == code and doc["exit_code"] == code, (args, p.stderr)
        assert {r["canary"]: r["verdict"] for r in doc["results"]}["add"] != "identical"


def test_help_version_and_validate_import_only_what_they_use(tmp_path):
    """Issue #16: the CPU figures are bench/cli_startup.py's; here, what must stay unimported."""
    assert canaryd("init", str(tmp_path)).returncode == 0
    heavy = ["sqlalchemy", "httpx2", "httpcore2", "numpy", "structlog", "rich", "canaryd.store"]
    config = ["canaryd.backends", "canaryd.canaries"]  # the kinds' models: what only validate needs
    for args, unused in (
        (["--help"], heavy + config),
        (["--version"], heavy + config),
        (["history", "--help"], heavy + config),
        (["-c", str(tmp_path / "canaryd.toml"), "validate"], heavy),
    ):
        code = (
            "import sys\nfrom canaryd.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            # a module canaryd.lazy imports stays a _LazyModule until its first use
            f"loaded = [m for m in {unused!r} if type(sys.modules.get(m)).__name__ == 'module']\n"
            "print('LOADED', loaded)"
        )
        p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
        assert "LOADED []" in p.stdout, (args, p.stdout[-300:], p.stderr)


@pytest.mark.parametrize("users", [None, "", "logfire"])
def test_canaryd_skips_pydantic_plugins_and_preflight_runs_the_command_as_the_user_started_it(
    tmp_path, users
):
    """canaryd turns pydantic's look for plugins off in its own process (#29: 20-50 ms of each start), unless
    the user set the switch; the command `preflight` runs gets the environment and umask the user gave."""
    lab = ScriptedLab(tmp_path, scripted())
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    if users is not None:
        env["PYDANTIC_DISABLE_PLUGINS"] = users

    def run(*argv: str) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, env=env, umask=0o022, timeout=120
        )
        assert p.returncode == 0, p.stderr
        return p

    switch = "os.environ.get('PYDANTIC_DISABLE_PLUGINS')"
    entry = (
        f"import os\nfrom canaryd.__main__ import main\ntry:\n    main()\nfinally:\n    print(repr({switch}))"
    )
    own = run("-c", entry, "--version").stdout.splitlines()[-1]
    assert own == repr("__all__" if users is None else users)

    cli = ("-m", "canaryd", "-c", str(lab.path))
    run(*cli, "pin", "--out", str(tmp_path / "pin.json"))
    seen = tmp_path / "seen.json"
    show = f"import json, os; json.dump([{switch}, os.umask(0)], open({str(seen)!r}, 'w'))"
    pre = ("preflight", "--pin", str(tmp_path / "pin.json"), "--out", str(tmp_path / "out"))
    run(*cli, *pre, "--", sys.executable, "-c", show)
    assert json.loads(seen.read_text()) == [users, 0o022]


def test_validate_still_checks_each_kinds_own_settings(tmp_path):
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(
        f"suites = ['{REPO / 'canaries/default.toml'}']\n[[backends]]\nname='o'\nkind='openai'\n"
        "base_url='http://127.0.0.1:9/v1'\nmodel='m'\ntimeout_s='soon'\n"
    )
    p = canaryd("validate", "-c", str(cfg))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "backends[0].timeout_s" in p.stderr, p.stderr
