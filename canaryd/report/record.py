"""Explain a flip and write the reproducibility record, both from the store alone.

The record is five lines kept next to an evaluation number: (1) the whole stack per backend, (2) whether
it matched the pin, (3) the canaries run for that session, (4) what changed and what to revert, one change
at a time, (5) where the raw log is stored. It reads only the store (and the pin file it is given), so
it can be regenerated later for any stored run.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from itertools import pairwise

from canaryd import __version__
from canaryd.backends import REVERT_LAST, revert_first
from canaryd.errors import InputError
from canaryd.judge.compare import Verdict, basis_of, text_delta, token_delta
from canaryd.observation import Observation
from canaryd.report.pin import Pin, check_pin
from canaryd.stack import FieldChange, configurations_of, diff, merge_stacks, split, stack_hash
from canaryd.store import RunStacks, Store, StoredObservation

RECORD_FORMAT = "canaryd-record/1"


def iso(t: datetime) -> str:
    """UTC, second precision, with a Z (SQLite hands datetimes back naive, but they are all UTC)."""
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def last_flip(verdicts: Iterable[tuple[int, str]]) -> tuple[int, int] | None:
    """(last good, first bad) ids of the most recent identical/baseline → drift transition (or → the first
    answer of a new serving configuration, which is no drift but is where the answers' source moved).

    ``verdicts`` is (observation id, verdict), newest first. Errors are skipped: they are never judged,
    so they neither end a good streak nor start a bad one.
    """
    first_bad = None
    for oid, v in verdicts:
        verdict = Verdict(v)
        if verdict is Verdict.ERROR:
            continue
        if verdict.is_drift or (verdict is Verdict.NEW_CONFIG and first_bad is None):
            first_bad = oid  # the oldest drift of the newest streak is where it flipped
        elif first_bad is not None:
            return oid, first_bad
    return None


def revert_rank(field: str) -> int:
    head = next((s for s in field.split(".") if s != "host"), "")
    first = revert_first()
    if head in first:
        return first.index(head)
    if head in REVERT_LAST:
        return len(first) + 1 + REVERT_LAST.index(head)
    return len(first)  # unknown families: after the settings, before the derived fields


def _shown(v: str | None) -> str:
    return "(absent)" if v is None else v


def suggest(changes: Sequence[FieldChange]) -> str:
    """Line 4 of the record: change one thing at a time until the result flips back."""
    if not changes:
        return (
            "no recorded stack field changed between them: the cause is outside the snapshot (batching, "
            "load, kernel nondeterminism); probe again: if it flips back by itself it is noise"
        )
    if len(changes) == 1:
        c = changes[0]
        return (
            f"one field changed: {c.field} from {_shown(c.before)} to {_shown(c.after)}"
            " — revert it to confirm"
        )
    ordered = sorted(changes, key=lambda c: (revert_rank(c.field), c.field))
    steps = "; ".join(
        f"{i}. {c.field} ({_shown(c.before)} -> {_shown(c.after)})" for i, c in enumerate(ordered, 1)
    )
    return (
        f"{len(changes)} fields changed at once: change them back one at a time, probing after each, "
        f"in this order (settings first, server-reported fields last): {steps}"
    )


def _changes_of(row: StoredObservation, key: str) -> list[FieldChange]:
    return [FieldChange(c["field"], c["before"], c["after"]) for c in row.comparison.get(key, [])]


def _change_dicts(changes: Sequence[FieldChange]) -> list[dict]:
    return [{"field": c.field, "from": c.before, "to": c.after} for c in changes]


def _moved(delta: dict | None) -> float | None:
    vals = [v for k in ("max_abs_dlogprob", "max_abs_dtop") if (v := (delta or {}).get(k)) is not None]
    return max(vals) if vals else None


def _basis(row: StoredObservation) -> str:
    """What the verdict rests on, "logprobs" or "text" (a comparison stored before bases were: logprobs)."""
    return row.comparison.get("basis") or "logprobs"


def _side(row: StoredObservation) -> dict:
    delta = row.comparison.get("delta")
    return {
        "observation_id": row.id,
        "time": iso(row.started_at),
        "verdict": row.verdict,
        "basis": _basis(row),
        "correct": row.correct,
        "text": row.text,
        "fingerprint": row.system_fingerprint,
        "max_abs_dlogprob": _moved(delta),  # vs that observation's baseline
        "first_divergence": (delta or {}).get("first_divergence"),
        "reasons": row.comparison.get("reasons", []),
    }


def explain_flip(
    good: tuple[StoredObservation, Observation], bad: tuple[StoredObservation, Observation]
) -> dict:
    """The last good and first bad observation side by side, what moved between them, what to revert."""
    (good_row, good_obs), (bad_row, bad_obs) = good, bad
    changes = diff(good_obs.stack, bad_obs.stack)
    between = (
        token_delta(good_obs.tokens, bad_obs.tokens)
        if basis_of(good_obs, bad_obs) == "logprobs"
        else text_delta(good_obs.text or "", bad_obs.text or "")  # first divergence in characters
    )
    return {
        "backend": bad_row.backend,
        "canary": bad_row.canary_id,
        "last_good": _side(good_row),
        "first_bad": _side(bad_row),
        "between": {
            "basis": basis_of(good_obs, bad_obs),
            "first_divergence": between.first_divergence,
            "max_abs_dlogprob": max(between.max_abs_dlogprob or 0.0, between.max_abs_dtop or 0.0),
            "text_identical": good_obs.text == bad_obs.text,
        },
        "stack_changes": _change_dicts(changes),
        "suggestion": suggest(changes),
    }


def last_stack_change(runs: Sequence[RunStacks]) -> dict | None:
    """The backend-level view: the newest pair of consecutive runs whose stacks differ (runs newest first)."""
    merged = [(r.run_id, r.started_at, merge_stacks(r.stacks)) for r in runs]
    for (new_id, new_t, new), (old_id, old_t, old) in pairwise(merged):
        changes, recorded = split(old, new)  # what only canaryd records differently is no stack change
        if changes:
            return {
                "from_run": old_id,
                "from_time": iso(old_t),
                "to_run": new_id,
                "to_time": iso(new_t),
                "stack_changes": _change_dicts(changes),
                **({"recording_changes": _change_dicts(recorded)} if recorded else {}),
                "suggestion": suggest(changes),
            }
    return None


def explain(store: Store, backend: str, canary: str | None = None) -> dict:
    """Every flip of a canary (or of each canary of the backend, plus its last stack change)."""
    known = store.canaries(backend)
    if not known or (canary is not None and canary not in known):
        what = f"canary {canary!r} on backend {backend!r}" if known else f"backend {backend!r}"
        raise InputError(f"explain: no observations of {what} in {store.url}")
    flips = []
    for c in [canary] if canary else known:
        verdicts = store.verdicts(backend, c)
        pair = last_flip(verdicts)
        verdicts.close()
        if pair is not None:
            good, bad = store.load(pair)
            flips.append(explain_flip(good, bad))
    stack = last_stack_change(store.run_stacks(backend)) if canary is None else None
    return {"backend": backend, "canary": canary, "flips": flips, "stack": stack}


def explain_text(doc: dict) -> str:
    """The human form of `explain`: one block per flip, columns side by side."""
    out: list[str] = []
    rows = [
        ("observation", "observation_id"),
        ("time (UTC)", "time"),
        ("verdict", "verdict"),
        ("correct", "correct"),
        ("text", "text"),
        ("fingerprint", "fingerprint"),
        ("max |Δ logprob|", "max_abs_dlogprob"),
        ("first divergence", "first_divergence"),
    ]
    for f in doc["flips"]:
        out.append(
            f"{f['backend']} / {f['canary']}: flipped at observation {f['first_bad']['observation_id']}"
        )
        out.append(f"  {'':<18} {'last good':<36} first bad")
        for label, key in rows:
            a, b = (_fmt(f[side][key], quote=key == "text") for side in ("last_good", "first_bad"))
            out.append(f"  {label:<18} {a:<36} {b}")
        bt = f["between"]
        out.append(
            f"  between them: first divergence {_fmt(bt['first_divergence'])}, "
            f"max |Δ logprob| {_fmt(bt['max_abs_dlogprob'])}"
        )
        out.extend(_change_lines(f["stack_changes"], "stack fields changed between them"))
        out.append(f"  => {f['suggestion']}")
        out.append("")
    if not doc["flips"]:
        what = f"{doc['backend']} / {doc['canary']}" if doc["canary"] else f"any canary of {doc['backend']}"
        out.append(f"nothing flipped: no identical/baseline -> drift transition for {what}")
    if doc.get("stack"):
        s = doc["stack"]
        out.append(
            f"{doc['backend']} stack last changed between run {s['from_run']} ({s['from_time']}) "
            f"and run {s['to_run']} ({s['to_time']})"
        )
        out.extend(_change_lines(s["stack_changes"], "fields"))
        out.append(f"  => {s['suggestion']}")
    return "\n".join(out).rstrip() + "\n"


def _fmt(v: object, quote: bool = False) -> str:
    """Table text: yes/no, 3 significant digits, ``-`` for none; answers quoted so whitespace shows."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    return repr(v) if quote else str(v)


def _change_lines(changes: list[dict], title: str) -> list[str]:
    if not changes:
        return [f"  {title}: none"]
    return [f"  {title}:"] + [f"    {c['field']}: {_shown(c['from'])} -> {_shown(c['to'])}" for c in changes]


def record_of(
    store: Store, run_ids: Sequence[int], since: str | None, pin: Pin | None, pin_path: str
) -> dict:
    """`canaryd record`: the record of these runs (found ``since`` a time), kept from pruning."""
    if not run_ids:
        raise InputError(f"record: no runs since {since}")
    rec = build_record(store, run_ids, pin=pin, pin_path=pin_path, version=__version__)
    store.keep(rec["storage"]["observation_ids"], "record")
    return rec


def build_record(
    store: Store,
    run_ids: Sequence[int],
    *,
    pin: Pin | None = None,
    pin_path: str = "",
    version: str = "",
) -> dict:
    """The record of a session (one or more runs), as a JSON-ready dict; see the module docstring."""
    pairs = store.load(store.ids_of_runs(run_ids))
    if not pairs:
        raise InputError(f"record: no observations in run(s) {', '.join(map(str, run_ids))}")
    rows = [row for row, _ in pairs]
    backends = sorted({r.backend for r in rows})
    stacks = {b: merge_stacks(o.stack for row, o in pairs if row.backend == b and o.ok) for b in backends}
    configurations = {
        b: tuple(configurations_of(o.stack for row, o in pairs if row.backend == b and o.ok))
        for b in backends
    }
    changes, recorded = [], {b: {} for b in backends}  # recording changes: once per backend and field
    for r in rows:
        recorded[r.backend].update({c.field: c for c in _changes_of(r, "recording_changes")})
        if Verdict(r.verdict).is_drift:
            moved = _changes_of(r, "stack_changes")
            changes.append(
                {
                    "backend": r.backend,
                    "canary": r.canary_id,
                    "observation_id": r.id,
                    "baseline_id": r.baseline_id,
                    "verdict": r.verdict,
                    "basis": _basis(r),
                    "reasons": r.comparison.get("reasons", []),
                    "stack_changes": _change_dicts(moved),  # vs the baseline
                    "suggestion": suggest(moved),
                }
            )
    return {
        "format": RECORD_FORMAT,
        "canaryd": version,
        "created": iso(datetime.now(UTC)),
        "session": {
            "runs": sorted(set(run_ids)),
            "from": iso(min(r.started_at for r in rows)),
            "to": iso(max(r.started_at for r in rows)),
        },
        "stack": {
            b: {
                "kind": s.get("backend.kind"),
                "stack_hash": stack_hash(s) if s else None,
                "fields": s,
                # the serving configurations that answered ("" an answer naming none)
                "configurations": list(configurations[b]),
                **({"recording_changes": _change_dicts(recorded[b].values())} if recorded[b] else {}),
            }
            for b, s in stacks.items()
        },
        "pin": check_pin(pin, stacks, pin_path, configurations).as_dict() if pin is not None else None,
        "canaries": [
            {
                "backend": r.backend,
                "canary": r.canary_id,
                "suite": r.suite,
                "run_id": r.run_id,
                "observation_id": r.id,
                "time": iso(r.started_at),
                "verdict": r.verdict,
                "basis": _basis(r),
                "correct": r.correct,
                "text": r.text,
                "error": r.error,
                "request_hash": r.request_hash,
            }
            for r in rows
        ],
        "changes": changes,
        # the evaluation sessions these runs checked (`canaryd.api.Session`, preflight), oldest first
        "sessions": [x.as_dict() for x in store.sessions_of_runs(run_ids)],
        **({"refits": refits} if (refits := _refits(rows)) else {}),
        "storage": {
            "database": store.url,
            "observation_ids": [r.id for r in rows],
            "payload_hashes": sorted({r.payload_hash for r in rows if r.payload_hash}),
            "stack_hashes": sorted({r.stack_hash for r in rows if r.stack_hash}),
            "export": "canaryd export " + " ".join(f"--run {i}" for i in sorted(set(run_ids))),
        },
    }


def _refits(rows: Sequence) -> list[dict]:
    """The passes that refit a canary's noise model (``canaryd.judge.living``): honest noise that grew."""
    out = []
    for r in rows:
        note = ((r.comparison or {}).get("evidence") or {}).get("detail", {}).get("refit")
        if note:
            out.append({"backend": r.backend, "canary": r.canary_id, "observation_id": r.id, "refit": note})
    return out


def summarize(rec: dict) -> dict:
    """A record folded to what a post-run check needs: did anything move while the command ran?"""
    moved = bool(rec["changes"]) or (rec["pin"] is not None and not rec["pin"]["matches"])
    errors = any(c["verdict"] == Verdict.ERROR for c in rec["canaries"])
    return {
        "runs": rec["session"]["runs"],
        "verdicts": dict(Counter(c["verdict"] for c in rec["canaries"])),
        "observation_ids": rec["storage"]["observation_ids"],
        "pin": rec["pin"],
        "changes": rec["changes"],
        "held": not moved and not errors,
    }


def _cell(v: object) -> str:
    return _fmt(v).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def _pin_line(pin: dict | None) -> str:
    if pin is None:
        return "not checked (no pin file given)"
    if pin["matches"]:
        new = f"; {len(pin['new'])} new field(s) reported, not failing" if pin["new"] else ""
        return f"matches `{pin['file']}`{new}"
    parts = [
        f"{m['backend']} {m['field']}: {_shown(m['pinned'])} -> {_shown(m['now'])}" for m in pin["moved"]
    ]
    parts += [f"{b}: unreachable, cannot be confirmed" for b in pin["unreachable"]]
    return f"**moved** against `{pin['file']}`: " + "; ".join(parts)


def _configurations_note(ids: list[str] | None) -> str:
    """``, 2 serving configurations (a, b)``; unknown when no answer named one (or an older record)."""
    if not ids or not any(ids):
        return ", serving configurations unknown" if ids else ""
    n = len(ids)
    return f", {n} serving configuration{'s' if n != 1 else ''} ({', '.join(i or '(none)' for i in ids)})"


def _recording_note(changes: list[dict] | None) -> str:
    fields = ", ".join(f"{c['field']} ({_shown(c['from'])} -> {_shown(c['to'])})" for c in changes or ())
    return fields and f"; recorded differently by canaryd than at its baselines, not by the server: {fields}"


def session_line(x: dict) -> str:
    """One evaluation session in words: what ran, which configurations answered its samples, and whether
    the stack held. More than one configuration, or a stack that moved, is said in bold."""
    what = " ".join(filter(None, (x["harness"] and f"`{x['harness']}`", x["task"] and f"task `{x['task']}`")))
    n = len(x["configurations"])
    served = ", ".join(f"{c or '(unnamed)'}: {k}" for c, k in sorted(x["configurations"].items()))
    mixed = (
        f"**{n} serving configurations answered its samples** ({served})"
        if n > 1
        else (
            f"one serving configuration answered them ({served})"
            if n
            else "no sample reported its configuration"
        )
    )
    held = {None: "not checked after", True: "the stack held", False: "**the stack moved during it**"}
    before, after = (", ".join(map(str, x[k])) or "none" for k in ("runs_before", "runs_after"))
    return (
        f"Evaluation session {x['id']} ({what or 'unnamed'}), {x['started_at']} to {x['finished_at']}: "
        f"{x['samples']} samples; {mixed}; {held[x['held']]} (runs {before} before, {after} after)."
    )


def to_markdown(rec: dict) -> str:
    """The record for people: the five lines first, then the detail behind each."""
    s, st = rec["session"], rec["storage"]
    counts = Counter(c["verdict"] for c in rec["canaries"])
    stack_line = "; ".join(
        f"`{b}` ({v['kind'] or 'kind unknown'}) stack `{v['stack_hash']}`, {len(v['fields'])} fields"
        + _configurations_note(v.get("configurations"))
        + _recording_note(v.get("recording_changes"))
        for b, v in rec["stack"].items()
    )
    changes_line = (
        "none: every judged canary matched its baseline"
        if not rec["changes"]
        else f"{len(rec['changes'])} observation(s) drifted from their baselines (detail below)"
    )
    ids = st["observation_ids"]
    lines = [
        "# canaryd reproducibility record",
        "",
        f"Runs {', '.join(map(str, s['runs']))}, {s['from']} to {s['to']}; canaryd {rec['canaryd']}; "
        f"written {rec['created']}.",
        "",
        f"1. **Whole stack:** {stack_line}.",
        f"2. **Pin:** {_pin_line(rec['pin'])}.",
        f"3. **Canaries:** {len(rec['canaries'])} run: "
        + ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
        + ".",
        f"4. **Changes:** {changes_line}.",
        f"5. **Stored:** `{st['database']}`, observations {ids[0]}–{ids[-1]} ({len(ids)}); "
        f"raw export: `{st['export']}`.",
    ]
    if "command" in rec:
        c = rec["command"]
        lines += [
            "",
            f"Command `{shlex.join(c['argv'])}` ran {c['started']} to {c['finished']}, "
            f"exit {c['exit_code']}.",
        ]
    if "post_run" in rec:
        p = rec["post_run"]
        verdicts = ", ".join(f"{n} {v}" for v, n in sorted(p["verdicts"].items()))
        held = "the stack and canaries held" if p["held"] else "**something moved during the command**"
        lines.append(f"After it, canaries again (runs {', '.join(map(str, p['runs']))}): {verdicts}: {held}.")
    for x in rec.get("sessions", ()):
        lines += ["", session_line(x)]
    for b, v in rec["stack"].items():
        lines += ["", f"## 1. Stack of `{b}`", "", *_table(("field", "value"), sorted(v["fields"].items()))]
    lines += [
        "",
        "## 3. Canaries",
        "",
        *_table(
            ("backend", "canary", "observation", "verdict", "basis", "correct", "text"),
            (
                (
                    c["backend"],
                    c["canary"],
                    c["observation_id"],
                    c["verdict"],
                    c["basis"],
                    c["correct"],
                    c["text"] or c["error"],
                )
                for c in rec["canaries"]
            ),
        ),
    ]
    if rec.get("refits"):
        lines += ["", "## Noise models refit (honest noise that grew)", ""]
        lines += _table(
            ("backend", "canary", "observation", "refit"),
            ((f["backend"], f["canary"], f["observation_id"], f["refit"]) for f in rec["refits"]),
        )
    if rec["changes"]:
        lines += ["", "## 4. Changes (against each canary's baseline)", ""]
        for c in rec["changes"]:
            lines.append(
                f"- `{c['backend']}` / `{c['canary']}` observation {c['observation_id']} "
                f"(baseline {c['baseline_id']}): {c['verdict']} on {c['basis']}; {'; '.join(c['reasons'])}. "
                f"{c['suggestion']}."
            )
    lines += ["", "## 5. Stored payloads", "", *(f"- `{h}`" for h in st["payload_hashes"])]
    return "\n".join(lines) + "\n"


def export_lines(store: Store, run_ids: Sequence[int]) -> str:
    """`canaryd export`: the runs' observations as JSON lines, in id order."""
    pairs = store.load(store.ids_of_runs(run_ids))
    if not pairs:
        raise InputError(f"export: no observations in run(s) {', '.join(map(str, run_ids))}")
    return "".join(json.dumps(export_line(r, o), ensure_ascii=False) + "\n" for r, o in pairs)


def export_line(row: StoredObservation, obs: Observation) -> dict:
    """One observation with everything stored about it (tokens, logprobs, top-k, stack), JSON-ready.

    Python writes floats with ``repr``, the shortest text that reads back as the same float64, so the
    export is as lossless as the store.
    """
    t = row.started_at if row.started_at.tzinfo else row.started_at.replace(tzinfo=UTC)
    return {
        **row.as_dict(),
        "started_at": t.isoformat(),
        "stack": obs.stack,
        "tokens": [
            {
                "token": tok.token,
                "logprob": tok.logprob,
                "token_id": tok.token_id,
                "bytes": list(tok.bytes) if tok.bytes is not None else None,
                "top": [[alt, lp] for alt, lp in tok.top],
            }
            for tok in obs.tokens
        ],
    }
