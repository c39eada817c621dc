"""The HTML report in real headless Chromium, offline: it renders without a console message (no error, no
blocked resource, no policy violation), its script runs under its own Content-Security-Policy, the
numbers in the rendered DOM are ``canaryd diff --json``'s, the first divergence is marked, hovering a token
shows its Δ logprob, a hostile answer stays text, and a screenshot is written (``report.png`` in the
test's tmp dir). A missing Chromium fails the test.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
from pathlib import Path

from canaryd.report.html import write_report
from tests.harness.services import need
from tests.unit.test_html_report import PAYLOAD, Page, three_runs

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=3000",
]

# The harness's probe: collects uncaught errors into the DOM, then hovers the first token with a Δ logprob
# and writes what the page's tooltip shows.
PROBE = """
addEventListener("error",function(ev){var d=document.documentElement;
d.setAttribute("data-errors",(d.getAttribute("data-errors")||"")+ev.message+";");});
document.addEventListener("DOMContentLoaded",function(){
var t=document.querySelector("[data-dlp]:not([data-dlp=''])");
t.dispatchEvent(new MouseEvent("mouseover",{bubbles:true,clientX:20,clientY:20}));
var tip=document.getElementById("tip");
document.documentElement.setAttribute("data-hover",tip.style.display+"|"+tip.textContent);});
"""


def chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [need("chromium"), *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args, page.as_uri()]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def console_lines(p: subprocess.CompletedProcess) -> list[str]:
    return [line for line in p.stderr.splitlines() if ":CONSOLE" in line]


def with_probe(html: str) -> str:
    """The page with PROBE first in its head, its hash added to the page's own policy."""
    digest = base64.b64encode(hashlib.sha256(PROBE.encode()).digest()).decode()
    html, n = re.subn(r"script-src ('sha256-[^']+')", rf"script-src \1 'sha256-{digest}'", html)
    assert n == 1
    return html.replace("<title>", f"<script>{PROBE}</script><title>", 1)


def test_report_in_chromium(tmp_path: Path) -> None:
    (tmp_path / "lab").mkdir()
    lab, runs = three_runs(tmp_path / "lab")
    try:
        page = tmp_path / "report.html"
        write_report(lab.store, runs, page)
        pairs = [runs[0], runs[1], runs[1], runs[2]]
        doc = json.loads(lab.cli("diff", "--json", *map(str, pairs)).stdout)
    finally:
        lab.close()

    shown = chromium(page, tmp_path, "--dump-dom")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert not console_lines(shown), console_lines(shown)
    dom = Page(shown.stdout)
    [(_, root, _)] = dom.find("html")
    assert root.get("data-ready") == "1"  # the page's script ran to its end under its policy
    title = dom.find("title")[0][2]  # the head's (the charts have their own)
    assert title.startswith("canaryd report") and "pwned" not in shown.stdout.split("<body")[0]
    assert sum(1 for t, _, _ in dom.elements if t == "script") == 1
    assert PAYLOAD not in shown.stdout and not dom.find("img")  # stored markup stays text

    for pair in doc["pairs"]:
        for metric, key in (("answers", "final_answers"), ("steps", "steps"), ("questions", "questions")):
            [(_, cell, text)] = dom.find("td", data_pair=pair["label"], data_metric=metric)
            assert text.startswith(f"{pair[key]['changed']} / {pair[key]['compared']}")
            assert int(cell["data-changed"]) == pair[key]["changed"]
        for score in pair["scores"]:
            [(_, cell, _)] = dom.find("td", data_run=str(pair["run_b"]["run_id"]), data_suite=score["suite"])
            assert int(cell["data-correct"]) == score["b"]["correct"]
    marked = [a for t, a, _ in dom.elements if t == "span" and "data-first-divergence" in a]
    assert marked and len(marked) % 2 == 0  # on both rows of each changed step

    probed = tmp_path / "probed.html"
    probed.write_text(with_probe(page.read_text()))
    hovered = chromium(probed, tmp_path, "--dump-dom")
    assert not console_lines(hovered), console_lines(hovered)
    [(_, root, _)] = Page(hovered.stdout).find("html")
    assert "data-errors" not in root
    moved = next(a for t, a, _ in dom.elements if t == "span" and a.get("data-dlp"))
    assert root["data-hover"] == f"block|{moved['data-tip']}" and "Δ" in moved["data-tip"]

    png = tmp_path / "report.png"
    shot = chromium(page, tmp_path, "--window-size=1280,1800", f"--screenshot={png}")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
