"""Fixtures shared by the unit modules that drive the scripted kind through the real dispatch."""

from __future__ import annotations

import pytest

from tests.harness.scripted_lab import ScriptedLab


@pytest.fixture
def make(tmp_path):
    """``make(backends, **kwargs)``: a `ScriptedLab` in ``tmp_path``, closed after the test. A module whose
    labs need other defaults (suites, noise) defines its own ``make``."""
    labs = []

    def build(backends: str, **kwargs) -> ScriptedLab:
        lab = ScriptedLab(tmp_path, backends, **kwargs)
        labs.append(lab)
        return lab

    yield build
    for lab in labs:
        lab.close()
