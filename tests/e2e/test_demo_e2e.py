"""The README's first command, `canaryd demo`, end to end: a tiny model trained on the spot, a real vLLM (CPU)
server, probe → baseline → identical re-probe → silent bfloat16 restart → drift verdict, exit 0. Its three
runs' HTML report, opened in real Chromium, leads with the third run's drift."""

import io
import re
import sqlite3
import subprocess
import sys

import pytest

from tests.e2e.test_report_chromium import chromium
from tests.unit.test_html_report import Page

pytestmark = pytest.mark.vllm


def test_demo_shows_the_whole_loop_and_exits_0(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "canaryd", "demo", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "\r" not in p.stderr  # piped: no progress line
    said = " ".join(p.stdout.split())  # rich wraps long lines
    m = re.search(
        r"OK: baseline (\d+), identical on re-probe (\d+), drift after the silent shift (\d+) of (\d+)\.",
        said,
    )
    assert m, said[-2000:]
    baseline, identical, drift, total = map(int, m.groups())
    assert baseline == identical == total > 0 and 0 < drift <= total
    db = tmp_path / "demo" / "state" / "canaryd.db"
    runs = [str(r) for (r,) in sqlite3.connect(db).execute("select id from run order by id")]
    assert len(runs) == 3

    html = tmp_path / "report.html"
    config = str(tmp_path / "demo" / "canaryd.toml")
    made = subprocess.run(
        [sys.executable, "-m", "canaryd", "-c", config, "report", *runs, "--out", str(html)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    shown = chromium(html, tmp_path, "--dump-dom")
    assert shown.returncode == 0, shown.stderr[-2000:]
    dom = Page(shown.stdout)
    leads = [text for _, _, text in dom.find("li") if text.startswith("Run ")]
    # the first screen: run 3 is named as not comparable, with the demo's own drift count
    assert leads and leads[0].startswith(f"Run {runs[2]} (local-vllm): {drift} of {total} canaries drifted")
    assert leads[0].endswith("not comparable with the runs before it.") and len(leads) == 1
    assert shown.stdout.index('id="moved"') < shown.stdout.index('id="summary"')


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_training_the_demo_model_shows_its_steps_on_a_terminal(tmp_path):
    """The demo's longest silent stretch was training: its steps count on the progress line."""
    from canaryd.lab.tinymodel import build_tiny_model
    from canaryd.progress import shown

    term = _Terminal()
    with shown("training", "steps", stream=term):
        build_tiny_model(tmp_path / "model", seed=0, train=[("What is 2 + 2?", "4")], steps=3)
    drawn = term.getvalue()
    assert "training 1/3 steps on the tiny model" in drawn or "training 3/3 steps on the tiny model" in drawn
    assert drawn.endswith("\r")  # erased at the end: the tables start on a clean line
