"""The HTML report on runs of the scripted kind: its numbers are ``canaryd diff --json``'s, its token diffs
mark the first divergence, stored strings stay inert text, and nothing in it reaches for the network.

`three_runs` is shared with the Chromium test (tests/e2e/test_report_chromium.py), which renders the page.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from canaryd.judge.compare import token_delta
from canaryd.judge.verdicts import Verdict
from canaryd.report.html import render, write_report
from canaryd.report.rundiff import diff_pairs
from tests.harness.scripted_lab import PLAIN, ScriptedLab, change, scripted

PAYLOAD = "<script>document.title='pwned'</script><b>x</b>"
HOSTILE_STACK = "<img src=x onerror=\"document.title='pwned'\">"
GREET = """
[suite]
name = "greet"
[[canary]]
id = "greet"
prompt = "Say hello."
decoding = { max_tokens = 64 }
expect = { regex = "^hello", answer = "hello there" }
"""


def three_runs(root: Path) -> tuple[ScriptedLab, list[int]]:
    """Three passes: an answer and the engine's dtype (with a derived cache size) move at run 2; a hostile
    answer, a hostile stack value and a second fingerprint appear at run 3."""
    body = (
        change(at=2, canaries=["add"], text="41")
        + change(at=2, stack={"engine.dtype": "float16", "gpu.cache_blocks": "900"}, logprob_shift=-0.01)
        + change(at=3, canaries=["greet"], text=PAYLOAD, stack={"env.NOTE": HOSTILE_STACK})
        + change(at=3, canaries=["colors"], fingerprint="fp_other")
    )
    stack = {"engine.dtype": "bfloat16", "gpu.cache_blocks": "1000"}
    lab = ScriptedLab(root, scripted(body=body, stack=stack), {"plain.toml": PLAIN, "greet.toml": GREET})
    return lab, [lab.cycle().run_id for _ in range(3)]


class Page(HTMLParser):
    """Every element as (tag, attributes, own text), and every text node."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict, list[str]]] = []
        self.stack: list[list[str]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        text: list[str] = []
        self.elements.append((tag, dict(attrs), text))
        if tag not in ("meta", "line", "circle", "polyline", "br"):
            self.stack.append(text)

    def handle_endtag(self, tag: str) -> None:
        if self.stack and tag not in ("meta", "line", "circle", "polyline", "br"):
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        if self.stack:
            self.stack[-1].append(data)

    def find(self, tag: str | None = None, **attrs: str) -> list[tuple[str, dict, str]]:
        return [
            (t, a, "".join(x))
            for t, a, x in self.elements
            if (tag is None or t == tag) and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    lab, runs = three_runs(tmp_path_factory.mktemp("html"))
    yield lab, runs, lab.root / "report.html"
    lab.close()


@pytest.fixture(scope="module")
def page(lab) -> tuple[str, Page]:
    lab_, runs, path = lab
    size = write_report(lab_.store, runs, path)
    html = path.read_text()
    assert size == len(html.encode())
    return html, Page(html)


def test_summary_numbers_are_the_diff_modules(lab, page) -> None:
    lab_, runs, _ = lab
    _, p = page
    p_ = lab_.cli("diff", "--json", *map(str, [runs[0], runs[1], runs[1], runs[2]]))
    doc = json.loads(p_.stdout)
    assert len(doc["pairs"]) == 2
    for pair in doc["pairs"]:
        for metric, key in (("answers", "final_answers"), ("steps", "steps"), ("questions", "questions")):
            [(_, cell, _)] = p.find("td", data_pair=pair["label"], data_metric=metric)
            for field in ("changed", "compared", "errors"):
                assert int(cell[f"data-{field}"]) == pair[key][field], (pair["label"], metric, field)
        top = pair["largest_score_movement"]
        [(_, cell, _)] = p.find("td", data_pair=pair["label"], data_metric="largest_move")
        assert (top is None) == ("data-points" not in cell)
        if top is not None:
            assert float(cell["data-points"]) == pytest.approx(top["points"])
        for run_doc in (pair["run_a"], pair["run_b"]):
            rid = str(run_doc["run_id"])
            [(_, _, fps)] = p.find("td", data_run=rid, data_metric="fingerprints")
            [(_, _, hashes)] = p.find("td", data_run=rid, data_metric="stack_hashes")
            assert int(fps) == len(run_doc["system_fingerprints"])
            assert int(hashes) == len(run_doc["stack_hashes"])
        for score in pair["scores"]:
            for side, key in ((pair["run_a"], "a"), (pair["run_b"], "b")):
                [(_, cell, _)] = p.find("td", data_run=str(side["run_id"]), data_suite=score["suite"])
                assert (int(cell["data-correct"]), int(cell["data-judged"])) == (
                    score[key]["correct"],
                    score[key]["judged"],
                )
    # the data set moves something in each pair, so the equalities above are not all zeros
    assert all(pair["steps"]["changed"] for pair in doc["pairs"])


def test_changed_steps_shown_token_by_token_with_the_first_divergence_marked(lab, page) -> None:
    lab_, runs, _ = lab
    _, p = page
    diffs = diff_pairs(lab_.store, [runs[0], runs[1], runs[1], runs[2]])
    for d, (a, b) in zip(diffs, [(runs[0], runs[1]), (runs[1], runs[2])], strict=True):
        shown = {attrs["data-canary"] for _, attrs, _ in p.find("div", data_pair=d.label)}
        assert shown == set(d.first_changed_step.values())
        for cid in shown:
            (_, oa), (_, ob) = (
                next(x for x in lab_.store.load(lab_.store.ids_of_runs([r])) if x[0].canary_id == cid)
                for r in (a, b)
            )
            expected = token_delta(oa.tokens, ob.tokens).first_divergence
            assert expected is not None
            # the page's order: A's row then B's; each marks the same position
            i = next(
                n
                for n, (t, at, _) in enumerate(p.elements)
                if at.get("data-canary") == cid and t == "div" and at.get("data-pair") == d.label
            )
            tokens = [at for t, at, _ in p.elements[i:] if t == "span" and "data-i" in at]
            marked = [at for at in tokens[: len(oa.tokens) + len(ob.tokens)] if "data-first-divergence" in at]
            assert [int(at["data-i"]) for at in marked] == [expected, expected]


def test_delta_logprob_shown_as_colour_and_on_hover(page) -> None:
    _, p = page
    shifted = [a for _, a, _ in p.find("span") if a.get("data-dlp")]
    assert shifted, "the logprob shift of run 2 shows on the tokens before the divergence"
    for a in shifted:
        delta = float(a["data-dlp"])
        assert "Δ" in a["title"] and a["title"] == a["data-tip"]
        assert ("rgba(220,40,40" if delta < 0 else "rgba(40,90,220") in a["style"]


def test_stored_strings_are_escaped_and_inert(lab, page) -> None:
    _, runs, _ = lab
    html, p = page
    assert "<script>document" not in html and "<b>x</b>" not in html and "<img" not in html
    assert [x for _, _, x in p.find("td") if x == HOSTILE_STACK]  # the stack value, shown as text
    assert sum(1 for t, _, _ in p.elements if t == "script") == 1  # the page's own, nothing stored
    assert all(text != "x" for _, _, text in p.find("b"))
    i = next(n for n, (_, a, _) in enumerate(p.elements) if a.get("data-canary") == "greet")
    row = next(n for n, (_, a, _) in enumerate(p.elements) if n > i and a.get("data-run") == str(runs[2]))
    shown = ["".join(text) for _, a, text in p.elements[row + 1 : row + 2 + len(PAYLOAD)] if "data-i" in a]
    assert "".join(shown) == PAYLOAD  # the answer is there, as text


def test_self_contained(page) -> None:
    html, p = page
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html, re.I)
    assert not [a for t, a, _ in p.elements if t in ("link", "img", "iframe", "object") or a.get("src")]
    [(_, csp, _)] = p.find("meta", http_equiv="Content-Security-Policy")
    assert (
        "default-src 'none'" in csp["content"]
        and "unsafe-inline" not in csp["content"].split("script-src")[1]
    )
    assert len(html.encode()) < 100_000


def test_chart_marks_verdicts_and_the_stack_change(page) -> None:
    _, p = page
    charts = p.find("svg")
    assert {a["data-canary"] for _, a, _ in charts} >= {"add", "greet"}
    verdicts = {a["data-verdict"] for _, a, _ in p.find("circle")}
    assert {"baseline", "regression"} <= verdicts
    assert p.find("line", **{"class": "stack-change"})


def test_stack_diff_lists_cause_fields_first(page) -> None:
    _, p = page
    rows = [(a["class"], a["data-field"]) for t, a, _ in p.elements if t == "tr" and "data-field" in a]
    assert ("cause", "engine.dtype") in rows and ("derived", "gpu.cache_blocks") in rows
    assert rows.index(("cause", "engine.dtype")) < rows.index(("derived", "gpu.cache_blocks"))


def test_reproducibility_record_five_lines(page) -> None:
    _, p = page
    [(_, ol, _)] = p.find("ol", id="record-lines")
    i = next(n for n, (t, a, _) in enumerate(p.elements) if a is ol)
    items = [text for t, _, text in p.elements[i + 1 :] if t == "li"]
    assert len(items) == 5


def test_commands_write_it(lab, tmp_path: Path) -> None:
    lab_, runs, _ = lab
    a, b, c = map(str, runs)
    for args in (
        ("report", a, b, c, "--out", str(tmp_path / "r.html")),
        ("diff", a, b, "--html", str(tmp_path / "d.html")),
        (
            "record",
            "--run",
            a,
            "--run",
            b,
            "--out",
            str(tmp_path / "rec.md"),
            "--html",
            str(tmp_path / "rec.html"),
        ),
    ):
        p = lab_.cli(*args)
        assert p.returncode in (0, 1), p.stderr  # diff exits 1: something changed
        out = Path(args[args.index("--out" if args[0] == "report" else "--html") + 1])
        assert out.read_text().startswith("<!doctype html>")
    unknown = lab_.cli("report", "999", "--out", str(tmp_path / "x.html"))
    assert unknown.returncode == 2 and "no run 999" in unknown.stderr and "Traceback" not in unknown.stderr


def test_render_without_changes(tmp_path: Path) -> None:
    lab = ScriptedLab(tmp_path, scripted())
    try:
        runs = [lab.cycle().run_id for _ in range(2)]
        p = Page(render(lab.store, runs))
        [(_, cell, _)] = p.find("td", data_metric="steps")
        assert cell["data-changed"] == "0" and not p.find("div", **{"class": "step"})
        assert p.find("svg")  # history is still shown for the first canaries
    finally:
        lab.close()


def test_what_moved_leads_the_page_with_each_runs_verdicts(lab, page) -> None:
    lab_, runs, _ = lab
    html, p = page
    assert html.index("id=moved") < html.index("id=summary")  # the first screen
    drifted = {}
    for rid in runs:
        rows = lab_.store.load(lab_.store.ids_of_runs([rid]))
        per: dict[str, list[str]] = {}
        for row, _ in rows:
            per.setdefault(row.canary_id, []).append(row.verdict)
        worst = {c: Verdict.most_severe(v) for c, v in per.items()}
        cells = {a["data-verdicts"]: a for _, a, _ in p.find("td", data_run=str(rid)) if "data-verdicts" in a}
        assert sum(int(a["data-count"]) for a in cells.values()) == len(worst)  # each canary once
        assert {int(a["data-of"]) for a in cells.values()} == {len(worst)}
        assert int(cells["drift"]["data-count"]) == sum(v.is_drift for v in worst.values())
        assert int(cells["errors"]["data-count"]) == sum(v is Verdict.ERROR for v in worst.values())
        assert int(cells["new-configuration"]["data-count"]) == sum(
            v is Verdict.NEW_CONFIG for v in worst.values()
        )
        drifted[rid] = sum(v.is_drift for v in worst.values())
    assert drifted[runs[0]] == 0 and drifted[runs[1]] > 0  # the data set drifts at run 2
    leads = [text for _, _, text in p.find("li") if text.startswith("Run ")]
    assert leads[0].startswith(f"Run {runs[1]} (fake): {drifted[runs[1]]} of ")
    assert "not comparable" in leads[0]
    assert not any(t.startswith(f"Run {runs[0]} ") for t in leads)  # the baselines' run is quiet
