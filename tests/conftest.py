"""Shared fixtures: the tiny models the integration tests serve with a real vLLM.

Models are built once and cached under ``.cache/test-models`` (or ``$CANARYD_TEST_CACHE``). Nothing
here skips: if vLLM or torch is missing, the integration tests fail, as CI must.
"""

import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same fuzz examples every run, so a landing is never refused by a newly drawn case;
# local runs keep drawing new ones, which is where new cases get found (and then pinned as tests).
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("CANARYD_TEST_CACHE", REPO / ".cache" / "test-models"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from canaryd.lab.tinymodel import build_tiny_model

    return build_tiny_model(CACHE / "random-seed0", seed=0)


@pytest.fixture(scope="session")
def int8_model(tiny_model: Path) -> Path:
    from canaryd.lab.tinymodel import perturb_weights

    return perturb_weights(tiny_model, CACHE / "random-seed0-int8", mode="int8")
