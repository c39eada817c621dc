"""The Inspect AI hook's own rules (the whole hook runs in a real `inspect eval` in
tests/e2e/test_harnesses_vllm.py): it is installed through the ``inspect_ai`` entry point, silent unless
``CANARYD_CONFIG`` is set, finds the backend by base URL and model, and reads each sample's serving
configuration from the replies in its model events."""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

import canaryd.api as api
from canaryd.harnesses.inspect_hook import CanarydHooks, match_backend, sample_configurations

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "a"
kind = "openai"
base_url = "http://127.0.0.1:8000/v1"
model = "tiny"
[[backends]]
name = "b"
kind = "openai"
base_url = "http://127.0.0.1:9000/v1/"
model = "tiny"
"""


@pytest.fixture
def cd(tmp_path, monkeypatch):
    monkeypatch.delenv("CANARYD_BACKEND", raising=False)
    (tmp_path / "suite.toml").write_text('[suite]\nname = "s"\n[[canary]]\nid = "x"\nprompt = "x"\n')
    (tmp_path / "canaryd.toml").write_text(CONFIG)
    return api.load(tmp_path / "canaryd.toml")


def test_installed_through_the_entry_point_and_silent_without_a_config(monkeypatch):
    assert "canaryd.harnesses.inspect_hook" in {e.value for e in entry_points(group="inspect_ai")}
    monkeypatch.delenv("CANARYD_CONFIG", raising=False)
    assert not CanarydHooks().enabled()
    monkeypatch.setenv("CANARYD_CONFIG", "canaryd.toml")
    assert CanarydHooks().enabled()


def test_the_backend_is_the_one_at_the_models_url(cd, monkeypatch):
    assert match_backend(cd, "openai-api/bed/tiny", "http://127.0.0.1:9000/v1") == "b"
    assert match_backend(cd, "openai-api/bed/tiny", "http://127.0.0.1:8000") == "a"
    with pytest.raises(api.InputError, match="several canaryd backend"):
        match_backend(cd, "openai-api/bed/tiny", None)
    with pytest.raises(api.InputError, match=r"no canaryd backend.*serve other at"):
        match_backend(cd, "openai-api/bed/other", "http://127.0.0.1:8000/v1")
    monkeypatch.setenv("CANARYD_BACKEND", "a")
    assert match_backend(cd, "openai-api/bed/other", None) == "a"
    monkeypatch.setenv("CANARYD_BACKEND", "zz")
    with pytest.raises(api.InputError, match="CANARYD_BACKEND=zz"):
        match_backend(cd, "openai-api/bed/tiny", None)


def model_event(response: dict | None) -> SimpleNamespace:
    return SimpleNamespace(
        event="model", call=None if response is None else SimpleNamespace(response=response)
    )


def test_a_samples_configurations_come_from_its_model_calls():
    sample = SimpleNamespace(
        events=[
            SimpleNamespace(event="state", call=None),
            model_event({"system_fingerprint": "fp_a"}),
            model_event({"system_fingerprint": "fp_a", "id": "2"}),
            model_event({"system_fingerprint": "fp_b"}),
            model_event(None),
        ]
    )
    got = sample_configurations(sample)
    assert got == {
        api.configuration_of_response({"system_fingerprint": "fp_a"}),
        api.configuration_of_response({"system_fingerprint": "fp_b"}),
    }
    assert sample_configurations(SimpleNamespace(events=[])) == set()
