"""The test bed of the scripted-kind unit tests: a config folder whose backends are ``kind = "scripted"``.

Everything but the network is real: the config file goes through `canaryd.config.load_config` (so the
scripted blocks are validated by the registry's union like every kind's), the canary files through the
suite loader, backends come from `canaryd.backends.make_backend` (the shared retries and circuit breaker
included), passes run through `canaryd.probe.run.probe_backend` and land in a real SQLite file in the
folder. A backend is built once and kept, so its cycle count (one per snapshot, i.e. per pass) goes on
from pass to pass as it does in the daemon; ``cycle_file`` carries it across ``canaryd`` processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from canaryd.backends import Backend, make_backend
from canaryd.canaries import Canary, load_suites
from canaryd.config import Config, load_config
from canaryd.probe.run import BackendRun, plan, probe_backend
from canaryd.store import Store
from tests.harness.suites import PLAIN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scripted(name: str = "fake", body: str = "", **settings: object) -> str:
    """A ``[[backends]]`` block of the scripted kind: fast (no latency, no backoff) unless overridden.
    ``body`` is appended verbatim (``[[backends.changes]]`` tables go there)."""
    values = {"latency_s": 0, "retry_backoff": 0, **settings}
    lines = [f"name = {json.dumps(name)}", 'kind = "scripted"']
    lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    return "[[backends]]\n" + "\n".join(lines) + "\n" + body


def change(**fields: object) -> str:
    """One ``[[backends.changes]]`` table."""
    return "[[backends.changes]]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in fields.items())


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, Path):
        return json.dumps(str(v))
    return json.dumps(v)


class ScriptedLab:
    """``suites``: file name → TOML text, listed in that order; ``backends``: the ``[[backends]]`` blocks;
    ``tail``: TOML after them (``[compare]``, ``[daemon]``, ``[[schedules]]`` ...)."""

    def __init__(self, root: Path, backends: str, suites: dict[str, str] | None = None, tail: str = ""):
        self.root = root
        self.path = root / "canaryd.toml"
        self._backends: dict[str, Backend] = {}
        self.write(backends, suites or {"plain.toml": PLAIN}, tail)
        self.store = Store(self.config.storage_url)

    def write(self, backends: str, suites: dict[str, str] | None = None, tail: str = "") -> None:
        """(Re)write the config (and suites); backends built from the old one are dropped."""
        if suites is not None:
            for name, text in suites.items():
                (self.root / name).write_text(text)
            self.suite_files = list(suites)
        self.path.write_text(
            f'state_dir = "state"\nsuites = {json.dumps(self.suite_files)}\n{backends}\n{tail}'
        )
        self.close_backends()
        self.config: Config = load_config(self.path)

    def backend(self, name: str = "fake") -> Backend:
        if name not in self._backends:
            self._backends[name] = make_backend(self.config.backend(name))
        return self._backends[name]

    def canaries(self, name: str = "fake") -> list[Canary]:
        return plan(self.config, load_suites([s.path for s in self.config.suites]), only=name)[name]

    def count_requests(self, name: str = "fake") -> list[str]:
        """From now on, the canary id of every request that reaches the kind (past retries and breaker)."""
        prober = self.backend(name).prober
        sent: list[str] = []
        attempt = prober.attempt
        prober.attempt = lambda canary: sent.append(canary.id) or attempt(canary)
        return sent

    def cycle(self, name: str = "fake") -> BackendRun:
        """One probe pass of a backend: snapshot, probes, judgement, detector fold, store (its reference, if
        it names one, is the lab's backend of that name: kept from pass to pass, as the daemon keeps it)."""
        ref = self.config.backend(name).reference
        reference = self.backend(ref) if ref is not None else None
        return probe_backend(self.backend(name), self.canaries(name), self.store, self.config, reference)

    def baselines(self, ids: list[str], name: str = "fake") -> list[int | None]:
        """The baseline observation id of each canary (or step) id, None where there is none."""
        found = [self.store.baseline(name, i) for i in ids]
        return [b.observation_id if b else None for b in found]

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(self.path), *args],
            capture_output=True,
            text=True,
            env={**os.environ, "NO_COLOR": "1"},
            timeout=120,
        )

    def check_json(self) -> tuple[int, dict]:
        p = self.cli("check", "--json")
        assert "Traceback" not in p.stderr, p.stderr
        return p.returncode, json.loads(p.stdout)

    def close_backends(self) -> None:
        for b in self._backends.values():
            b.close()
        self._backends.clear()

    def close(self) -> None:
        self.close_backends()
        self.store.close()


def verdicts(run: BackendRun) -> dict[str, str]:
    """Canary (or step) id → verdict; a sampled canary's n observations share one."""
    out: dict[str, str] = {}
    for r in run.results:
        out.setdefault(r.observation.canary_id, r.comparison.verdict.value)
    return out


def by_id(run: BackendRun) -> dict:
    """Canary (or step) id → its (last) result."""
    return {r.observation.canary_id: r for r in run.results}
