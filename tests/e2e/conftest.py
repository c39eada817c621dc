"""Fixtures of the end-to-end suite: the tiny models the tests serve with a real vLLM.

Models are built once and cached under ``.cache/test-models`` (or ``$CANARYD_TEST_CACHE``). Nothing
here skips: if vLLM or torch is missing, the tests that need them fail, as CI must.
"""

import os
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
CACHE = Path(os.environ.get("CANARYD_TEST_CACHE", REPO / ".cache" / "test-models"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from canaryd.lab.tinymodel import build_tiny_model

    return build_tiny_model(CACHE / "random-seed0", seed=0)


@pytest.fixture(scope="session")
def int8_model(tiny_model: Path) -> Path:
    from canaryd.lab.tinymodel import perturb_weights

    return perturb_weights(tiny_model, CACHE / "random-seed0-int8", mode="int8")


@pytest.fixture(scope="session")
def int4_model(tiny_model: Path) -> Path:
    from canaryd.lab.tinymodel import perturb_weights

    return perturb_weights(tiny_model, CACHE / "random-seed0-int4", mode="int4")


@pytest.fixture(scope="session")
def seed1_model() -> Path:
    """A differently seeded model of the same shape: another checkpoint behind the same name."""
    from canaryd.lab.tinymodel import build_tiny_model

    return build_tiny_model(CACHE / "random-seed1", seed=1)
