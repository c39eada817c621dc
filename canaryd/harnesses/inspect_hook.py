"""canaryd inside Inspect AI: the serving stack's record in every eval log, from a hook.

Installed through the ``inspect_ai`` entry point (``pip install "llm-canaryd[inspect]"``) and off, silent,
unless ``CANARYD_CONFIG`` names a canaryd config. Per task, through `canaryd.api` (the CLI's own path):

* **task start**: find the canaryd backend that serves the eval's model (``CANARYD_BACKEND``, else the one
  whose ``base_url`` and ``model`` match the model's base URL and name), and open a session on it: its
  canaries run and, with ``CANARYD_PIN``, the pin is checked.
* **each sample**: the serving configuration that answered it, from the provider's own reply in the
  sample's model events (its ``system_fingerprint``, provider, routing headers): no extra request.
* **task end**: probe again and write the record beside the log (``canaryd-record.<log>.json`` and
  ``.md``) and a summary into the log's ``eval.metadata["canaryd"]`` (what ``inspect view`` shows): the
  stack, the pin, the verdicts before and after, the configurations that served the samples with their
  counts, and a ``warning`` when more than one configuration answered or the stack moved.

A hook cannot fail a run by raising: Inspect catches every exception from a hook and logs a warning, except
`LimitExceededError`, which it lets through so that limits can be enforced from hooks
(``inspect_ai/hooks/_hooks.py``, ``_emit_to_all``). A moved stack at task start therefore raises one (a
``custom`` limit, its message saying what moved), which ends the task as an error before any sample is
sent, unless ``CANARYD_ON_MOVED=mark``: then the eval runs and its log says the stack had moved. For a
gate that does not depend on a hook at all, wrap the command: ``canaryd preflight --pin … -- inspect eval …``.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from inspect_ai.hooks import Hooks, SampleEnd, TaskEnd, TaskStart, hooks
from inspect_ai.log import read_eval_log, write_eval_log
from inspect_ai.util import LimitExceededError

from canaryd import api

ENV_CONFIG, ENV_PIN, ENV_BACKEND, ENV_ON_MOVED = (
    "CANARYD_CONFIG",
    "CANARYD_PIN",
    "CANARYD_BACKEND",
    "CANARYD_ON_MOVED",
)


def _strip(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def match_backend(cd: api.Canaryd, model: str, base_url: str | None) -> str:
    """The canaryd backend that serves Inspect's ``model`` (``provider/…/name``) at ``base_url``:
    ``CANARYD_BACKEND`` when set, else the one backend whose base URL and model name match. An
    `api.InputError` names what did not match."""
    names = [b.name for b in cd.config.backends]
    if (named := os.environ.get(ENV_BACKEND)) is not None:
        if named not in names:
            raise api.InputError(f"{ENV_BACKEND}={named}: no such backend in {cd.config.path}")
        return named
    served = model.rsplit("/", 1)[-1]
    hits = [
        b.name
        for b in cd.config.backends
        if getattr(b, "model", None) == served
        and (base_url is None or _strip(str(getattr(b, "base_url", ""))) == _strip(base_url))
    ]
    if len(hits) != 1:
        where = f" at {base_url}" if base_url else ""
        found = "several" if hits else "no"
        raise api.InputError(
            f"{found} canaryd backend(s) in {cd.config.path} serve {served}{where}: set {ENV_BACKEND}"
        )
    return hits[0]


def _base_url(spec: Any) -> str | None:
    """The model's base URL: the eval's own, else the provider's ``<SERVICE>_BASE_URL`` variable."""
    if getattr(spec, "model_base_url", None):
        return str(spec.model_base_url)
    parts = str(spec.model).split("/")
    service = parts[1] if parts[0] == "openai-api" and len(parts) > 2 else parts[0]
    return os.environ.get(f"{service.upper().replace('-', '_')}_BASE_URL")


def sample_configurations(sample: Any) -> set[str]:
    """The serving configurations of a sample's model calls, from the replies the provider sent."""
    out = set()
    for event in getattr(sample, "events", None) or ():
        call = getattr(event, "call", None) if getattr(event, "event", None) == "model" else None
        if call is not None and isinstance(call.response, dict):
            out.add(api.configuration_of_response(call.response))
    return out


def summary(session: api.Session, record_path: Path) -> dict:
    """What the eval log's metadata says: enough to see at a glance whether the numbers are comparable."""
    rec = session.record or {}
    before = session.before.passed if session.before is not None else None
    counts: dict[str, int] = {}
    for r in before.results if before is not None else ():
        counts[r.comparison.verdict.value] = counts.get(r.comparison.verdict.value, 0) + 1
    configurations = dict(sorted(session.evaluation.configurations.items()))
    warnings = []
    if len(configurations) > 1:
        warnings.append(f"{len(configurations)} serving configurations answered the samples")
    if session.held is False:
        warnings.append("the stack moved during the eval")
    return {
        "record": str(record_path),
        "backend": session.backend,
        "stack_hash": {b: v["stack_hash"] for b, v in rec.get("stack", {}).items()},
        "pin": None if rec.get("pin") is None else bool(rec["pin"]["matches"]),
        "verdicts_before": counts,
        "verdicts_after": (rec.get("post_run") or {}).get("verdicts"),
        "held": session.held,
        "samples": session.evaluation.samples,
        "configurations": configurations,
        "warning": "; ".join(warnings) or None,
    }


@hooks(name="canaryd", description="canaryd: the serving stack's reproducibility record in each eval log")
class CanarydHooks(Hooks):
    """One instance per process (Inspect's rule): sessions are kept per ``eval_id``."""

    def __init__(self) -> None:
        self._sessions: dict[str, api.Session] = {}
        self._marked: dict[str, str] = {}  # eval_id → why the stack had moved (CANARYD_ON_MOVED=mark)

    def enabled(self) -> bool:
        return bool(os.environ.get(ENV_CONFIG))

    async def on_task_start(self, data: TaskStart) -> None:
        cd = api.load(os.environ[ENV_CONFIG])
        backend = match_backend(cd, str(data.spec.model), _base_url(data.spec))
        session = cd.session(
            pin=os.environ.get(ENV_PIN) or None,
            out_dir=Path("."),
            backend=backend,
            harness="inspect",
            task=str(data.spec.task),
        )
        try:
            await asyncio.to_thread(session.__enter__)
        except api.StackMoved as e:
            if os.environ.get(ENV_ON_MOVED, "stop") != "mark":
                raise LimitExceededError("custom", value=1, limit=0, message=f"canaryd: {e}") from None
            self._marked[data.eval_id] = str(e)
            return
        self._sessions[data.eval_id] = session

    async def on_sample_end(self, data: SampleEnd) -> None:
        session = self._sessions.get(data.eval_id)
        if session is not None:
            for configuration in sample_configurations(data.sample) or {""}:
                session.sample(configuration=configuration)

    async def on_task_end(self, data: TaskEnd) -> None:
        location = str(data.log.location or "")
        if data.eval_id in self._marked:
            doc = {"warning": f"the stack had moved before the eval: {self._marked.pop(data.eval_id)}"}
            await asyncio.to_thread(_annotate, location, doc)
            return
        session = self._sessions.pop(data.eval_id, None)
        if session is None or not location:
            return
        stem = Path(location).name.rsplit(".", 1)[0]
        session.out_dir = Path(location).parent
        session.record_name = f"canaryd-record.{stem}"  # a name Inspect does not list as a log
        await asyncio.to_thread(session.__exit__, None, None, None)
        doc = summary(session, session.out_dir / f"{session.record_name}.json")
        await asyncio.to_thread(_annotate, location, doc)


def _annotate(location: str, doc: dict) -> None:
    """``doc`` into the written log's ``eval.metadata["canaryd"]``, through Inspect's own log API."""
    log = read_eval_log(location)
    log.eval.metadata = {**(log.eval.metadata or {}), "canaryd": json.loads(json.dumps(doc))}
    write_eval_log(log, location)
