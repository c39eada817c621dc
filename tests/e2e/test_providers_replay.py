"""Each cloud provider family, replayed from recorded real bodies (tests/harness/providers.py), as a new
user meets it:

(i)   no profile: ``check`` exits 2 naming the backend, the refused parameter and the profile key that fixes
      it, or, where the family works without one, gives a judged observation;
(ii)  ``doctor --write``, then ``check``: a baseline, then ``identical``, on the evidence the family has;
(iii) a silent change scripted on the provider's side is caught (exit 1), the evidence basis named.

Everything but the provider is real: the ``canaryd`` command in a subprocess, its config, SQLite history.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness.providers import KEY, Replay
from tests.harness.suites import ADD, ANSWERS, CAPITAL, GREEDY, suite

SUITE = suite("cloud", GREEDY, ADD, CAPITAL)


@dataclass(frozen=True)
class Family:
    basis: str  # the evidence a judged observation rests on once profiled
    refused: str | None = None  # without a profile: the parameter refused ...
    fix: str | None = None  # ... and the profile key the message names (None: works without a profile)
    unprofiled_basis: str | None = None  # the basis of the observation it gives without a profile
    change: dict = field(default_factory=dict)  # the silent change (iii)


FAMILIES = {
    "openai-chat": Family("logprobs", unprofiled_basis="logprobs", change={"fingerprint": "fp_rotated01"}),
    "openai-reasoning": Family(
        "text", refused="max_tokens", fix="request.token_param", change={"reasoning_tokens": 16}
    ),
    "anthropic-compat": Family(
        "text", refused="top_p", fix="request.omit", change={"answer": {"17 + 25": "41"}}
    ),
    "gemini-compat": Family("text", refused="logprobs", fix="request.logprobs", change={"prompt_tokens": 40}),
    "openrouter": Family("text", unprofiled_basis="text", change={"prompt_tokens": 25}),
    "together": Family("logprobs", unprofiled_basis="logprobs", change={"logprob": -0.5}),
    "groq": Family(
        "text", refused="logprobs", fix="request.logprobs", change={"fingerprint": "fp_rotated02"}
    ),
    "mistral": Family(
        "text", refused="seed", fix="request.omit", change={"answer": {"capital of France": "Lyon"}}
    ),
    "xai": Family(
        "text", refused="presence_penalty", fix="request.omit", change={"fingerprint": "fp_rotated03"}
    ),
    "deepseek": Family("logprobs", unprofiled_basis="logprobs", change={"logprob": -0.5}),
}


class Bed:
    """A config folder whose one backend ``cloud`` is a replayed family."""

    def __init__(self, root: Path, base: str, kind: str = "openai") -> None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "cloud.toml").write_text(SUITE)
        self.path = root / "canaryd.toml"
        self.path.write_text(
            'state_dir = "state"\nsuites = ["cloud.toml"]\n\n[[backends]]\nname = "cloud"\n'
            f'kind = "{kind}"\nbase_url = "{base}"\nmodel = "m"\napi_key_env = "REPLAY_KEY"\nretries = 0\n'
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(self.path), *args],
            capture_output=True,
            text=True,
            env={**os.environ, "REPLAY_KEY": KEY, "NO_COLOR": "1"},
            timeout=120,
        )
        assert "Traceback" not in p.stderr, p.stderr
        return p

    def check(self) -> tuple[int, dict, str]:
        p = self.cli("check", "--json")
        return p.returncode, json.loads(p.stdout), p.stderr


def basis(result: dict) -> str | None:
    """The evidence basis a result names (``basis``, or inside ``evidence``)."""
    return result.get("basis") or (result.get("evidence") or {}).get("basis")


def verdicts(doc: dict) -> dict[str, str]:
    return {r["canary"]: r["verdict"] for r in doc["results"]}


@pytest.fixture
def replay():
    with Replay(ANSWERS) as r:
        yield r


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_without_a_profile(name: str, replay: Replay, tmp_path: Path) -> None:
    fam = FAMILIES[name]
    code, doc, err = Bed(tmp_path, replay.base(name)).check()
    if fam.fix is None:  # works as it is: judged, on the evidence the family returns
        assert code == doc["exit_code"] == 0, err
        assert {r["error"] for r in doc["results"]} == {None}
        assert {basis(r) for r in doc["results"]} == {fam.unprofiled_basis}
        return
    assert code == doc["exit_code"] == 2, err
    assert {r["error_kind"] for r in doc["results"]} == {"config"}
    for r in doc["results"]:  # one line naming the backend, the refused parameter and the key to set
        line = r["error"]
        assert "\n" not in line and "cloud" in line and fam.refused in line and fam.fix in line, line


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_doctor_writes_a_profile_that_check_then_judges_with(
    name: str, replay: Replay, tmp_path: Path
) -> None:
    fam = FAMILIES[name]
    bed = Bed(tmp_path, replay.base(name))
    p = bed.cli("doctor", "cloud", "--write")
    assert p.returncode == 0, p.stderr
    assert "[backends.request]" in bed.path.read_text()

    start = len(replay.got(name))
    code, doc, err = bed.check()
    assert code == 0, err
    assert set(verdicts(doc).values()) == {"baseline"}
    code, doc, err = bed.check()
    assert code == 0, err
    assert set(verdicts(doc).values()) == {"identical"}
    assert {basis(r) for r in doc["results"]} == {fam.basis}
    assert all(r["correct"] for r in doc["results"])
    sent = [g for g in replay.got(name)[start:]]
    assert sent and all(g.status == 200 for g in sent)  # the profile sends nothing the provider refuses
    if fam.refused and fam.refused != "logprobs":
        assert not any(fam.refused in g.body for g in sent)
    if name == "openai-reasoning":  # the hidden-reasoning budget is added to each canary's own max_tokens
        assert {g.body["max_completion_tokens"] for g in sent} == {16 + 512}
        assert {g.body["reasoning_effort"] for g in sent} == {"low"}
    if name == "mistral":
        assert {g.body["random_seed"] for g in sent} == {0}

    replay.change(**fam.change)
    code, doc, err = bed.check()
    assert code == doc["exit_code"] == 1, err
    moved = [r for r in doc["results"] if r["verdict"] != "identical"]
    assert moved and {basis(r) for r in moved} == {fam.basis}


def test_the_responses_api(replay: Replay, tmp_path: Path) -> None:
    """The Responses API (kind ``openai-responses``): logprobs through ``include``, then a silent change."""
    bed = Bed(tmp_path, replay.base("openai-responses"), kind="openai-responses")
    code, doc, err = bed.check()
    assert code == 0, err
    sent = replay.sent("openai-responses", "/responses")
    assert sent and all("message.output_text.logprobs" in b["include"] for b in sent)
    code, doc, err = bed.check()
    assert code == 0 and set(verdicts(doc).values()) == {"identical"}, err
    assert {basis(r) for r in doc["results"]} == {"logprobs"}
    replay.change(logprob=-0.5)
    code, doc, err = bed.check()
    assert code == 1, err
