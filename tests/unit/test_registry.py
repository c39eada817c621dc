"""The backend registry, the kinds' own config blocks, and the resilience that wraps every kind."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Literal

import pytest

from canaryd import backends
from canaryd.backends import KINDS, BackendSettings, make_backend, settings_types
from canaryd.backends.resilience import Resilient
from canaryd.canaries import Canary
from canaryd.config import load_config
from canaryd.errors import InputError
from canaryd.observation import ErrorKind, Observation, utcnow
from canaryd.report.record import revert_rank

CANARY = Canary(id="c", messages=[{"role": "user", "content": "hi"}], suite="s")
MINIMAL = {
    "vllm": "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n",
    "openai": "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n",
    "openai-responses": "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n",
    "vllm-offline": "model = '/m'\n",
    "scripted": "",
    "sglang": "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n",
    "tgi": "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n",
    "ollama": "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n",
    "litellm": "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n",
    "llamacpp": "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n",
}


def config(tmp_path: Path, block: str) -> Path:
    path = tmp_path / "canaryd.toml"
    path.write_text(f"suites = ['s.toml']\n[[backends]]\nname = 'b'\n{block}")
    return path


def test_every_registered_kind_has_its_own_settings_tagged_by_its_name():
    assert set(MINIMAL) == set(KINDS)
    for kind, settings in zip(KINDS, settings_types(), strict=True):
        assert issubclass(settings, BackendSettings)
        assert settings.model_fields["kind"].annotation == Literal[kind]


@pytest.mark.parametrize("kind", list(MINIMAL))
def test_the_config_file_validates_each_kind_with_its_own_block(tmp_path, kind):
    cfg = load_config(config(tmp_path, f"kind = '{kind}'\n{MINIMAL[kind]}"))
    assert type(cfg.backends[0]) is settings_types()[list(KINDS).index(kind)]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("kind = 'triton'\nmodel = 'm'\n", "backends[0].kind: unknown kind 'triton' (known: vllm, openai"),
        ("model = 'm'\n", "backends[0].kind: kind is required"),
        ("kind = 'vllm'\nmodel = 'm'\n", "backends[0].base_url: Field required"),
        # a key of another kind names the field, without the union's tag in the path
        (
            "kind = 'vllm'\n" + MINIMAL["vllm"] + "engine = { dtype = 'x' }\n",
            "backends[0].engine: Extra inputs",
        ),
        ("kind = 'vllm-offline'\nmodel = 'm'\nbase_url = 'http://h/v1'\n", "backends[0].base_url: Extra"),
        ("kind = 'scripted'\nchanges = [{ at = 0 }]\n", "backends[0].changes[0].at"),
    ],
)
def test_kind_errors_name_the_field_on_one_line(tmp_path, block, message):
    path = config(tmp_path, block)
    with pytest.raises(InputError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: {message}") and "\n" not in str(err.value)


class Flaky:
    """A kind whose attempts answer from a script of outcomes (an ErrorKind, an exception, or None: ok)."""

    kind, concurrency = "flaky", 1

    def __init__(self, settings: BackendSettings, script: list) -> None:
        self.name, self.script, self.sent = settings.name, list(script), 0

    def snapshot(self) -> dict[str, str]:
        return {}

    def request(self, canary: Canary) -> dict:
        return {"c": canary.id}

    def request_hash(self, canary: Canary) -> str:
        return "h"

    def attempt(self, canary: Canary) -> Observation:
        self.sent += 1
        outcome = self.script.pop(0) if self.script else None
        if isinstance(outcome, Exception):
            raise outcome
        obs = Observation(self.name, canary.id, canary.suite, utcnow(), self.request(canary), "h", text="ok")
        if outcome is not None:
            obs.error_kind, obs.error = outcome, str(outcome)
            obs.headers = {"retry-after": "nan"} if outcome is ErrorKind.RATE_LIMITED else {}
        return obs

    def close(self) -> None:
        pass


def resilient(script: list, **settings) -> Resilient:
    s = BackendSettings(name="f", kind="flaky", model="m", retry_backoff=0, **settings)
    return Resilient(Flaky(s, script), s)


def test_transient_failures_are_retried_and_counted():
    b = resilient([ErrorKind.HTTP_5XX, ErrorKind.RATE_LIMITED], retries=2)
    obs = b.probe(CANARY)
    assert obs.ok and obs.attempts == 3 and b.prober.sent == 3  # Retry-After: nan is no wait, not a crash


def test_an_answer_that_is_wrong_is_never_retried_and_never_opens_the_breaker():
    b = resilient([ErrorKind.INVALID_RESPONSE] * 10, retries=3, breaker_failures=2)
    for _ in range(5):
        obs = b.probe(CANARY)
        assert obs.error_kind is ErrorKind.INVALID_RESPONSE and obs.attempts == 1
    assert b.breaker.state == "closed" and b.prober.sent == 5


def test_the_breaker_opens_after_repeated_transport_failures_and_stops_sending():
    b = resilient([ErrorKind.CONNECT] * 10, retries=0, breaker_failures=2, breaker_cooldown=3600)
    assert [b.probe(CANARY).error_kind for _ in range(2)] == [ErrorKind.CONNECT] * 2
    unsent = b.probe(CANARY)
    assert unsent.error_kind is ErrorKind.CIRCUIT_OPEN and unsent.attempts == 0 and b.prober.sent == 2
    assert unsent.request == {"c": "c"} and unsent.request_hash == "h"  # recorded as it would have gone


def test_an_exception_from_a_kind_costs_one_observation_not_the_pass():
    b = resilient([RuntimeError("kind bug")], retries=2)
    obs = b.probe(CANARY)
    assert obs.error_kind is ErrorKind.INTERNAL and "RuntimeError: kind bug" in obs.error
    assert obs.attempts == 1 and b.probe(CANARY).ok


def test_every_kind_with_a_version_field_ranks_its_family_as_an_engine_build():
    first = backends.revert_first()
    for kind in KINDS:
        field = getattr(backends._module(kind), "ENGINE_VERSION_FIELD", None)
        if field is not None and not field.startswith("gateway."):  # a gateway reports about itself: last
            assert revert_rank(field) < first.index("packages"), kind


def test_adding_a_kind_is_one_module_and_one_registry_line(monkeypatch):
    """What the recipe in docs/architecture.md promises: the registry finds the module's Settings and
    Prober, `make_backend` wraps it in the shared resilience, and `canaryd init` offers its example."""
    module = types.ModuleType("canaryd_test_kind")

    class Settings(BackendSettings):
        kind: Literal["echo"] = "echo"

    class Prober(Flaky):
        kind = "echo"

        def __init__(self, settings: Settings) -> None:
            super().__init__(settings, [ErrorKind.TIMEOUT])

    module.Settings, module.Prober, module.EXAMPLE = Settings, Prober, "# [[backends]]\n# kind = 'echo'\n"
    module.ENGINE_VERSION_FIELD = "echo.version"
    monkeypatch.setitem(sys.modules, "canaryd_test_kind", module)
    monkeypatch.setitem(KINDS, "echo", "canaryd_test_kind")
    backends._module.cache_clear()
    try:
        assert Settings in settings_types()
        b = make_backend(Settings(name="e", model="m", retry_backoff=0))
        assert isinstance(b, Resilient) and b.kind == "echo"
        assert b.probe(CANARY).attempts == 2  # the timeout was retried by the shared wrapper
        assert module.EXAMPLE in backends.examples()
        assert backends.engine_version("echo", {"echo.version": "7"}) == "7"
        # `explain` ranks its fields among the engine builds: after the settings, before the weights
        ranks = {f: revert_rank(f) for f in ("engine.dtype", "echo.version", "model.sha256", "nothing.x")}
        assert ranks["engine.dtype"] < ranks["echo.version"] < ranks["model.sha256"] < ranks["nothing.x"]
    finally:
        backends._module.cache_clear()
