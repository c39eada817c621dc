"""One self-contained HTML file for a set of runs (``canaryd report``, ``record --html``, ``diff --html``).

The file is what gets mailed, attached to a ticket or archived beside an evaluation number and opened
years later, so it needs no server and no network: CSS, the one script and the SVG charts are inline, and
a Content-Security-Policy lets the page load nothing and run nothing but its own script. Every stored
string (answers, canary ids, stack values) is untrusted and escaped; the policy is the second line of
defence should one ever slip through.

What it shows, in order: what moved, run by run (each run's canary verdicts: drift, within noise, new
configurations, errors, and a lead line naming every run that is not comparable with the one before it, so
the first screen says so), the seed study's summary (answers, steps and questions that changed per pair of
runs, scores per suite per run, the serving configurations behind each run: the very numbers of
``canaryd diff --json``), each changed step's two answers token by token (first divergence marked, each
token's Δ logprob as colour and on hover), a logprob and verdict history per changed canary with stack
changes marked, the stack diff with cause fields first, and the reproducibility record's five lines.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from itertools import pairwise
from pathlib import Path

from canaryd import __version__
from canaryd.backends import revert_first
from canaryd.errors import InputError
from canaryd.files import write_private
from canaryd.judge.compare import token_delta
from canaryd.judge.verdicts import Verdict
from canaryd.observation import Observation, TokenLogprob
from canaryd.report.record import build_record, iso, revert_rank, session_line, suggest, to_markdown
from canaryd.report.rundiff import PairDiff, Run, diff_runs, step_output
from canaryd.stack import FieldChange, diff, merge_stacks, split
from canaryd.store import EvalSession, Store, StoredObservation

MAX_STEPS = 40  # changed steps shown token by token per pair (the counts above them stay complete)
MAX_CHARTS = 12  # canaries given a history chart
HISTORY = 120  # observations per chart, newest first
COLOURS = {  # the verdict table's terminal colours, as CSS
    "magenta": "#b0b",
    "bold red": "#c00",
    "red": "#e33",
    "yellow": "#d9a400",
    "green": "#2a2",
    "cyan": "#09b",
}

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #ccc;margin-top:2em}h3{font-size:1em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:.2em .6em;text-align:left}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
code,.tokens{font-family:ui-monospace,monospace}.muted{color:#777}
.step{margin:1em 0;padding:.5em;border:1px solid #eee;border-radius:4px}
.tokens{display:flex;flex-wrap:wrap;margin:.2em 0;align-items:center}
.tokens .who{width:6em;color:#555}
.tok{white-space:pre;padding:1px 0;border:1px solid transparent}
.tok.after{color:#999}.tok.div1{color:#000;border-color:#000;outline:2px solid #e33}
tr.cause td:first-child{font-weight:600}tr.recording td{color:#888;font-style:italic}
svg{background:#fafafa;border:1px solid #eee}
#tip{position:fixed;display:none;background:#222;color:#fff;padding:2px 6px;border-radius:3px;
font:12px ui-monospace,monospace;pointer-events:none;white-space:pre}
"""

# Hover any element with a title: its text in a tooltip at once (the native one waits a second).
JS = """
(function(){var tip=document.getElementById("tip");
document.addEventListener("mouseover",function(e){var t=e.target.closest("[data-tip]");
if(!t){tip.style.display="none";return;}tip.textContent=t.getAttribute("data-tip");
tip.style.left=(e.clientX+12)+"px";tip.style.top=(e.clientY+12)+"px";tip.style.display="block";});
document.documentElement.setAttribute("data-ready","1");})();
"""


def _csp() -> str:
    digest = base64.b64encode(hashlib.sha256(JS.encode()).digest()).decode()
    return f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{digest}'"


def e(v: object) -> str:
    """Escaped text for an element or a double-quoted attribute."""
    return escape("-" if v is None else str(v), quote=True)


@dataclass(frozen=True, slots=True)
class LoadedRun:
    """A run as the diff module sees it, plus what only the report shows: tokens and the run's stack."""

    run: Run
    observations: dict[tuple[str, int], tuple[StoredObservation, Observation]]  # keyed as Run.questions
    stack: dict[str, str]  # merged over the run's answered observations


def load_run(store: Store, run_id: int) -> LoadedRun:
    """One stored run; an unknown id is an InputError (exit 2), as in ``canaryd diff``."""
    info = store.run(run_id)
    if info is None:
        raise InputError(f"report: no run {run_id} in {store.url}")
    pairs = store.load(store.ids_of_runs([run_id]))
    keyed: dict[tuple[str, int], tuple[StoredObservation, Observation]] = {}
    seen: dict[str, int] = {}
    for row, obs in pairs:
        n = seen[row.canary_id] = seen.get(row.canary_id, -1) + 1
        keyed[(row.canary_id, n)] = (row, obs)
    run = Run(run_id, info.backend, info.started_at, tuple(step_output(r, o) for r, o in pairs))
    return LoadedRun(run, keyed, merge_stacks(o.stack for _, o in pairs if o.ok))


Triple = tuple[LoadedRun, LoadedRun, PairDiff]  # run A, run B, B diffed against A


# -- sections ---------------------------------------------------------------------------------------

# The verdict rows of "What moved", in the order an evaluator asks: did anything drift, was it noise,
# did another server answer, did probes fail, and what stayed put.
_QUIET = (Verdict.IDENTICAL, Verdict.BASELINE)
_GROUPS = (
    ("Drift", "drift", lambda v: v.is_drift),
    ("Within noise", "noise", lambda v: v is Verdict.NOISE),
    ("Learning its noise", "learning", lambda v: v is Verdict.LEARNING),
    ("New serving configurations", "new-configuration", lambda v: v is Verdict.NEW_CONFIG),
    ("Errors", "errors", lambda v: v is Verdict.ERROR),
    ("Identical or baseline", "quiet", lambda v: v in _QUIET),
)


def _run_heads(runs: Sequence[LoadedRun]) -> str:
    cells = (f'<th data-run="{r.run.run_id}">run {r.run.run_id}<br>{e(r.run.backend)}</th>' for r in runs)
    return "".join(cells)


def run_verdicts(run: LoadedRun) -> dict[str, Verdict]:
    """Each canary's verdict in the run: the most severe over its steps (a chain's, a repeated id's)."""
    steps: dict[str, list[str]] = {}
    for row, _ in run.observations.values():
        steps.setdefault(row.canary_id, []).append(row.verdict)
    return {cid: Verdict.most_severe(vs) for cid, vs in sorted(steps.items())}


def _counted(verdicts: Sequence[Verdict]) -> str:
    counts: dict[Verdict, int] = {}
    for v in verdicts:
        counts[v] = counts.get(v, 0) + 1
    return ", ".join(f"{n} {v.value}" for v, n in sorted(counts.items(), key=lambda kv: kv[0].rank))


def _lead(run: LoadedRun, verdicts: dict[str, Verdict], first: bool) -> str | None:
    """One sentence for a run that an evaluator must not compare blindly, None for a quiet one."""
    n = len(verdicts)
    drift = [v for v in verdicts.values() if v.is_drift]
    new = sum(v is Verdict.NEW_CONFIG for v in verdicts.values())
    errors = sum(v is Verdict.ERROR for v in verdicts.values())
    parts = [f"{len(drift)} of {n} canaries drifted ({_counted(drift)})"] if drift else []
    parts += [f"{new} of {n} answered by a serving configuration not seen before"] if new else []
    parts += [f"{errors} of {n} failed and were not judged"] if errors else []
    if not parts:
        return None
    against = "its baselines" if first else "the runs before it"
    verdict = f"not comparable with {against}" if drift else "compare with care"
    return f"Run {run.run.run_id} ({run.run.backend}): {'; '.join(parts)}: {verdict}."


def verdict_section(runs: Sequence[LoadedRun], sessions: Sequence[EvalSession] = ()) -> str:
    """What moved, first: the lead lines, the evaluation sessions these runs checked, then each run's
    canaries counted by verdict group."""
    per_run = [run_verdicts(r) for r in runs]
    leads = [
        line for i, (r, v) in enumerate(zip(runs, per_run, strict=True)) if (line := _lead(r, v, i == 0))
    ]
    lead = (
        "".join(f"<li>{e(line)}</li>" for line in leads)
        if leads
        else "<li>No run drifted: every canary was identical, within its noise, learning or a baseline.</li>"
    )
    lead += "".join(f"<li class=session>{_inline_md(session_line(x.as_dict()))}</li>" for x in sessions)
    head = _run_heads(runs)
    rows = ""
    for title, key, member in _GROUPS:
        cells = ""
        for r, verdicts in zip(runs, per_run, strict=True):
            hit = [v for v in verdicts.values() if member(v)]
            detail = f" ({_counted(hit)})" if hit and key in ("drift", "quiet") else ""
            cells += (
                f'<td class="n" data-run="{r.run.run_id}" data-verdicts="{key}" data-count="{len(hit)}" '
                f'data-of="{len(verdicts)}">{len(hit)} / {len(verdicts)}{e(detail)}</td>'
            )
        rows += f"<tr><th>{title}</th>{cells}</tr>"
    return (
        f"<h2 id=moved>What moved</h2><ul id=lead>{lead}</ul>"
        f"<table id=verdicts><tr><th>Canaries per run</th>{head}</tr>{rows}</table>"
    )


def _count_cell(pair: PairDiff, metric: str, c: dict) -> str:
    errors = f" ({c['errors']} errors)" if c["errors"] else ""
    return (
        f'<td class="n" data-pair="{e(pair.label)}" data-metric="{metric}" data-changed="{c["changed"]}" '
        f'data-compared="{c["compared"]}" data-errors="{c["errors"]}">'
        f"{c['changed']} / {c['compared']}{errors}</td>"
    )


def summary_section(diffs: Sequence[PairDiff], runs: Sequence[LoadedRun]) -> str:
    """The seed study's two tables: what changed per pair of runs, and scores and configurations per run."""
    head = "".join(f"<th>{e(d.label)}</th>" for d in diffs)
    docs = [d.as_dict() for d in diffs]
    rows = [
        ("Final answers that changed", "answers", [x["final_answers"] for x in docs]),
        ("Reasoning steps that changed", "steps", [x["steps"] for x in docs]),
        ("Questions with any step change", "questions", [x["questions"] for x in docs]),
    ]
    body = "".join(
        f"<tr><th>{title}</th>"
        + "".join(_count_cell(d, key, c) for d, c in zip(diffs, cells, strict=True))
        + "</tr>"
        for title, key, cells in rows
    )
    moves = []
    for d, x in zip(diffs, docs, strict=True):
        top = x["largest_score_movement"]
        text = "-" if top is None else f"{top['points']:+.1f} points ({top['suite']})"
        value = "" if top is None else f' data-points="{top["points"]}"'
        moves.append(
            f'<td class="n" data-pair="{e(d.label)}" data-metric="largest_move"{value}>{e(text)}</td>'
        )
    flips = "".join(
        f'<td class="n" data-pair="{e(d.label)}" data-metric="flips">'
        f"{len(d.to_wrong)} correct→wrong, {len(d.to_right)} wrong→correct</td>"
        for d in diffs
    )
    body += f"<tr><th>Largest score movement on one suite</th>{''.join(moves)}</tr>"
    body += f"<tr><th>Answers that flipped</th>{flips}</tr>"
    pair_table = f"<table id=pairs><tr><th>Between runs</th>{head}</tr>{body}</table>"

    sums = [r.run.summary() for r in runs]
    rhead = _run_heads(runs)
    rrows = [
        ("Started (UTC)", "started", [iso(r.run.started_at) for r in runs]),
        ("Questions / steps", "size", [f"{s['questions']} / {s['steps']}" for s in sums]),
        ("Errors", "errors", [s["errors"] for s in sums]),
        (
            "Serving configurations (fingerprints)",
            "fingerprints",
            [len(s["system_fingerprints"]) for s in sums],
        ),
        ("Distinct stacks", "stack_hashes", [len(s["stack_hashes"]) for s in sums]),
    ]
    rbody = "".join(
        f"<tr><th>{title}</th>"
        + "".join(
            f'<td class="n" data-run="{s["run_id"]}" data-metric="{key}">{e(v)}</td>'
            for s, v in zip(sums, values, strict=True)
        )
        + "</tr>"
        for title, key, values in rrows
    )
    scores = [r.run.scores() for r in runs]
    for suite in sorted({s for sc in scores for s in sc}):
        cells = []
        for s, sc in zip(sums, scores, strict=True):
            score = sc.get(suite)
            data = "" if score is None else f' data-correct="{score.correct}" data-judged="{score.judged}"'
            cells.append(
                f'<td class="n" data-run="{s["run_id"]}" data-suite="{e(suite)}"{data}>{e(score or "-")}</td>'
            )
        rbody += f"<tr><th>Score: {e(suite)}</th>{''.join(cells)}</tr>"
    run_table = f"<table id=runs><tr><th>Run</th>{rhead}</tr>{rbody}</table>"
    return f"<h2 id=summary>Summary</h2>{pair_table}{run_table}"


def _shade(delta: float | None) -> str:
    """Δ logprob as a background: red where B's token got less likely, blue where more; 0.001 is faint,
    1 is full (a log scale: numerical drift spans orders of magnitude)."""
    if delta is None or delta == 0:
        return ""
    alpha = min(1.0, math.log10(1 + abs(delta) * 1000) / 3)
    rgb = "220,40,40" if delta < 0 else "40,90,220"
    return f' style="background:rgba({rgb},{alpha:.2f})"'


def _shown_token(t: str) -> str:
    return t.replace("\n", "↵").replace("\t", "→") or "∅"


def _token_row(
    who: str,
    run_id: int,
    tokens: Sequence[TokenLogprob],
    other: Sequence[TokenLogprob],
    first: int | None,
    text: str | None,
) -> str:
    if not tokens:
        return f'<div class="tokens" data-run="{run_id}"><span class="who">{e(who)}</span>{e(text)}</div>'
    spans = []
    for i, t in enumerate(tokens):
        aligned = first is None or i < first
        delta = t.logprob - other[i].logprob if aligned and i < len(other) else None
        cls = "tok" + (" div1" if i == first else "") + ("" if aligned else " after")
        tip = f"#{i} {t.token!r} logprob {t.logprob:.4f}"
        if delta is not None:
            tip += f" Δ {delta:+.4g}"
        elif not aligned:
            tip += " (after the first divergence)"
        mark = ' data-first-divergence="1"' if i == first else ""
        spans.append(
            f'<span class="{cls}" data-i="{i}" data-dlp="{"" if delta is None else f"{delta:.6g}"}"{mark} '
            f'title="{e(tip)}" data-tip="{e(tip)}"{_shade(delta)}>{e(_shown_token(t.token))}</span>'
        )
    if first is not None and first == len(tokens):  # this answer ended where the other went on
        spans.append('<span class="tok div1" data-first-divergence="1" title="ends here">⊣</span>')
    return f'<div class="tokens" data-run="{run_id}"><span class="who">{e(who)}</span>{"".join(spans)}</div>'


def _changed(a: tuple[StoredObservation, Observation], b: tuple[StoredObservation, Observation]) -> bool:
    """Changed as ``canaryd diff`` counts a step: both answered, and token ids (or tokens) or text differ."""
    x, y = step_output(*a), step_output(*b)
    return x.ok and y.ok and (x.tokens, x.text) != (y.tokens, y.text)


def changes_section(pairs: Sequence[Triple]) -> str:
    """Each changed step's two answers token by token; B's tokens coloured by their Δ logprob against A's
    (up to the first divergence: after it the tokens are different ones and a Δ means nothing)."""
    out = ["<h2 id=changes>What changed, token by token</h2>"]
    for a, b, d in pairs:
        changed = [
            k
            for k in a.observations
            if k in b.observations and _changed(a.observations[k], b.observations[k])
        ]
        out.append(f"<h3>{e(d.label)}: {len(changed)} step(s) changed</h3>")
        for cid, n in changed[:MAX_STEPS]:
            (ra, oa), (rb, ob) = a.observations[(cid, n)], b.observations[(cid, n)]
            first = token_delta(oa.tokens, ob.tokens).first_divergence
            occurrence = f" (draw {n + 1})" if n else ""
            out.append(
                f'<div class="step" data-pair="{e(d.label)}" data-canary="{e(cid)}">'
                f"<b>{e(cid)}</b>{occurrence} <span class=muted>suite {e(ra.suite)}; first divergence at "
                f"token {e(first)}; correct {e(ra.correct)} → {e(rb.correct)}; verdict in run "
                f"{b.run.run_id}: {e(rb.verdict)}</span>"
                + _token_row(f"run {a.run.run_id}", a.run.run_id, oa.tokens, (), first, oa.text)
                + _token_row(f"run {b.run.run_id}", b.run.run_id, ob.tokens, oa.tokens, first, ob.text)
                + "</div>"
            )
        if len(changed) > MAX_STEPS:
            out.append(
                f"<p class=muted>and {len(changed) - MAX_STEPS} more (see <code>canaryd diff</code>)</p>"
            )
    return "".join(out)


def _chart(store: Store, backend: str, canary_id: str, last_id: int) -> str:
    """Mean logprob per observation (the newest HISTORY up to the report's last), dots in the verdict's
    colour, a dashed line where the stack hash changed."""
    rows = [
        r for r in store.observations(backend=backend, canary_id=canary_id, limit=HISTORY) if r.id <= last_id
    ]
    points = [(r, o) for r, o in store.load([r.id for r in rows]) if o.tokens]
    if not points:
        return ""
    w, h, pad = 640, 160, 36
    means = [sum(t.logprob for t in o.tokens) / len(o.tokens) for _, o in points]
    lo, hi = min(means), max(means)
    span = (hi - lo) or max(abs(hi) * 0.01, 1e-6)
    xs = [pad + (w - 2 * pad) * (i / max(1, len(points) - 1)) for i in range(len(points))]
    ys = [h - pad - (h - 2 * pad) * ((m - lo) / span) for m in means]
    svg = [
        f'<svg class="chart" data-canary="{e(canary_id)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        f'role="img"><title>{e(canary_id)}: mean logprob per observation</title>',
        f'<text x="2" y="{pad - 8}" font-size="10">{hi:.4g}</text>',
        f'<text x="2" y="{h - pad + 12}" font-size="10">{lo:.4g}</text>',
    ]
    for i in range(1, len(points)):
        if points[i][0].stack_hash != points[i - 1][0].stack_hash:
            x = (xs[i] + xs[i - 1]) / 2
            tip = f"stack {points[i - 1][0].stack_hash} → {points[i][0].stack_hash}"
            svg.append(
                f'<line class="stack-change" x1="{x:.1f}" x2="{x:.1f}" y1="8" y2="{h - 8}" stroke="#80c" '
                f'stroke-dasharray="4 3" data-tip="{e(tip)}"><title>{e(tip)}</title></line>'
            )
    svg.append(
        '<polyline fill="none" stroke="#888" points="'
        + " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))
        + '"/>'
    )
    for (r, _), x, y, m in zip(points, xs, ys, means, strict=True):
        moved = r.comparison.get("delta") or {}
        tip = (
            f"observation {r.id} run {r.run_id} {iso(r.started_at)}: {r.verdict}, mean logprob {m:.5g}, "
            f"max |Δ| vs baseline {moved.get('max_abs_dlogprob')}"
        )
        known = r.verdict in Verdict._value2member_map_  # a newer canaryd may have stored a verdict we lack
        colour = COLOURS.get(Verdict(r.verdict).style, "#555") if known else "#555"
        svg.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}" data-verdict="{e(r.verdict)}" '
            f'data-tip="{e(tip)}"><title>{e(tip)}</title></circle>'
        )
    first, last = iso(points[0][0].started_at), iso(points[-1][0].started_at)
    svg.append(f'<text x="{pad}" y="{h - 6}" font-size="10">{e(first)}</text>')
    svg.append(f'<text x="{w - pad}" y="{h - 6}" font-size="10" text-anchor="end">{e(last)}</text>')
    return f"<h3>{e(backend)} / {e(canary_id)}</h3>" + "".join(svg) + "</svg>"


def history_section(store: Store, runs: Sequence[LoadedRun], pairs: Sequence[Triple]) -> str:
    """A chart per question that changed, of its first changed step (else of the first run's first
    canaries), up to the report's newest observation."""
    last_id = max(r.id for lr in runs for r, _ in lr.observations.values())
    wanted: dict[tuple[str, str], None] = {}
    for _, b, d in pairs:
        for step in d.first_changed_step.values():
            wanted.setdefault((b.run.backend, step), None)
    if not wanted:
        wanted = dict.fromkeys((runs[0].run.backend, cid) for cid, _ in list(runs[0].observations)[:3])
    charts = [_chart(store, backend, cid, last_id) for backend, cid in list(wanted)[:MAX_CHARTS]]
    legend = " ".join(
        f'<span style="color:{COLOURS.get(v.style, "#555")}">●</span> {e(v.value)}' for v in Verdict
    )
    return (
        "<h2 id=history>Logprob and verdict history</h2>"
        f"<p class=muted>Mean logprob of each observation; {legend}; dashed: the stack changed.</p>"
        + "".join(charts)
    )


def _row_class(change: FieldChange, recorded: Sequence[FieldChange]) -> str:
    if change in recorded:
        return "recording"
    return "cause" if revert_rank(change.field) < len(revert_first()) else "derived"


def stack_section(runs: Sequence[LoadedRun]) -> str:
    """Each consecutive pair's stack diff, cause fields (engine, configuration) before what they derive;
    fields only canaryd's recording rules moved (an upgrade: `canaryd.stack.split`) greyed, no cause."""
    out = ["<h2 id=stack>Stack changes</h2>"]
    for a, b in pairwise(runs):
        changes: list[FieldChange] = sorted(
            diff(a.stack, b.stack), key=lambda c: (revert_rank(c.field), c.field)
        )
        out.append(f"<h3>run {a.run.run_id} → run {b.run.run_id}: {len(changes)} field(s)</h3>")
        recorded = split(a.stack, b.stack)[1]  # canaryd's recording rules moved, not the stack
        if changes:
            rows = "".join(
                f'<tr class="{_row_class(c, recorded)}" '
                f'data-field="{e(c.field)}"><td><code>{e(c.field)}</code></td><td>{e(c.before)}</td>'
                f"<td>{e(c.after)}</td></tr>"
                for c in changes
            )
            out.append(
                f"<table class=stackdiff><tr><th>field</th><th>run {a.run.run_id}</th>"
                f"<th>run {b.run.run_id}</th></tr>{rows}</table>"
            )
        out.append(f"<p>{e(suggest([c for c in changes if c not in recorded]))}</p>")
    return "".join(out)


def _inline_md(line: str) -> str:
    """The record's markdown line as HTML: escaped first, then **bold** and `code` (always balanced)."""
    s = escape(line, quote=False)
    s = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", s)
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", s)


def record_section(store: Store, run_ids: Sequence[int]) -> str:
    """The reproducibility record's five lines, as ``canaryd record`` writes them for these runs."""
    rec = build_record(store, run_ids, version=__version__)
    five = [ln.split(". ", 1)[1] for ln in to_markdown(rec).splitlines() if re.match(r"^[1-5]\. ", ln)]
    items = "".join(f"<li>{_inline_md(ln)}</li>" for ln in five)
    return f"<h2 id=record>Reproducibility record</h2><ol id=record-lines>{items}</ol>"


def render(
    store: Store,
    run_ids: Sequence[int],
    pairs: Sequence[tuple[int, int]] | None = None,
    labels: Sequence[str] | None = None,
) -> str:
    """The page for these runs; ``pairs`` default to each run against the one before it."""
    order = list(dict.fromkeys(run_ids))
    if not order:
        raise InputError("report: no runs given")
    loaded = {rid: load_run(store, rid) for rid in order}
    if not any(r.observations for r in loaded.values()):
        raise InputError(f"report: no observations in run(s) {', '.join(map(str, order))}")
    pairs = list(pairs) if pairs is not None else list(pairwise(order))
    if labels and len(labels) != len(pairs):
        raise InputError(f"--label: {len(labels)} label(s) for {len(pairs)} pair(s) of runs")
    diffs = [
        diff_runs(loaded[a].run, loaded[b].run, labels[i] if labels else "") for i, (a, b) in enumerate(pairs)
    ]
    runs = [loaded[r] for r in order]
    triples = [(loaded[a], loaded[b], d) for (a, b), d in zip(pairs, diffs, strict=True)]
    title = f"canaryd report: runs {', '.join(map(str, order))}"
    body = (
        f"<h1>{e(title)}</h1><p class=muted>{e(store.url)}; canaryd {e(__version__)}</p>"
        + verdict_section(runs, store.sessions_of_runs(order))
        + summary_section(diffs, runs)
        + changes_section(triples)
        + history_section(store, runs, triples)
        + stack_section(runs)
        + record_section(store, order)
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_csp()}">'
        f"<title>{e(title)}</title><style>{CSS}</style></head>"
        f'<body>{body}<div id="tip"></div><script>{JS}</script></body></html>\n'
    )


def write_report(
    store: Store,
    run_ids: Sequence[int],
    path: Path,
    pairs: Sequence[tuple[int, int]] | None = None,
    labels: Sequence[str] | None = None,
) -> int:
    """Write the page to ``path`` (private, like every file canaryd writes); its size in bytes."""
    page = render(store, run_ids, pairs, labels)
    write_private(path, page)
    return len(page.encode())
