"""The CLI at a real terminal (a pseudo-terminal): progress on stderr, tables as wide as the window.

The piped side (plain tables, no progress, the ``--json`` envelope) is in tests/unit/test_cli.py.
"""

from __future__ import annotations

import os
import re
import sys

from tests.harness.scripted_lab import PLAIN, scripted
from tests.harness.terminal import run_in_terminal

BOX = set("┃━│─┏┡└╇")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _config(tmp_path, **settings) -> str:
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(f'state_dir = "state"\nsuites = ["plain.toml"]\n{scripted(**settings)}')
    return str(cfg)


def canaryd_at_terminal(*args: str, columns: int = 120):
    env = {**os.environ, "NO_COLOR": "1", "TERM": "xterm"}
    return run_in_terminal([sys.executable, "-m", "canaryd", *args], columns=columns, env=env)


def test_census_shows_progress_at_once_then_erases_it_for_the_table(tmp_path):
    cfg = _config(tmp_path, latency_s=0.02)
    screen = canaryd_at_terminal("census", "-c", cfg, "-n", "10", "--batch-sizes", "1,2")
    assert screen.returncode == 0, screen.text
    first = screen.first("census: …")  # at once, before the imports and the backend's set-up
    counting = screen.first("census: 0/60 probes on fake")
    table = screen.first("canaryd census")
    assert None not in (first, counting, table), screen.text
    assert first <= counting < table
    counts = [int(n) for n in re.findall(r"census: (\d+)/60 probes on fake", screen.text)]
    assert counts == sorted(counts) and counts[-1] == 60 and len(counts) >= 3
    # the line is blanked before the table, so the table starts on a clean line
    before_table = ANSI.sub("", screen.text).split("canaryd census")[0]
    assert before_table.endswith(" " * len("census: 60/60 probes on fake") + "\r")


def test_no_progress_beside_json_even_at_a_terminal(tmp_path):
    cfg = _config(tmp_path, latency_s=0.01)
    screen = canaryd_at_terminal("check", "-c", cfg, "--json")
    assert screen.returncode == 0, screen.text
    assert "probing" not in screen.text and '"exit_code": 0' in screen.text


def test_check_and_calibrate_show_progress(tmp_path):
    cfg = _config(tmp_path, latency_s=0.01)
    check = canaryd_at_terminal("check", "-c", cfg)
    assert check.returncode == 0 and "probing 3/3 canaries on fake" in check.text, check.text
    calibrate = canaryd_at_terminal("baseline", "calibrate", "-c", cfg, "-k", "2")
    assert "calibrating 3/3 canaries on fake" in calibrate.text, calibrate.text


def test_tables_take_the_terminal_width_and_draw_boxes(tmp_path):
    cfg = _config(tmp_path)
    widths = {}
    for columns in (70, 150):
        screen = canaryd_at_terminal("check", "-c", cfg, columns=columns)
        assert screen.returncode == 0, screen.text
        lines = [ANSI.sub("", line) for line in screen.text.replace("\r", "\n").splitlines()]
        table = [line for line in lines if BOX & set(line)]
        assert table, screen.text
        widths[columns] = max(len(line) for line in table)
        assert widths[columns] <= columns
    assert widths[70] < widths[150]  # the "why" column wraps in a narrow window, not at a fixed 160
