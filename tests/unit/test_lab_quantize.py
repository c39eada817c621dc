"""The weight perturbations the detection tests and benchmark serve as silently changed deployments: what
needs no torch (the round trips themselves are in tests/e2e/test_lab_quantize.py)."""

import pytest

from canaryd.lab import tinymodel


def test_unknown_mode_names_the_modes(tmp_path):
    with pytest.raises(ValueError, match="int8, int4, noise, prune"):
        tinymodel.perturb_weights(tmp_path, tmp_path / "out", mode="fp4")
