"""The README's first command, `canaryd demo`, end to end: a tiny model trained on the spot, a real vLLM (CPU)
server, probe → baseline → identical re-probe → silent bfloat16 restart → drift verdict, exit 0."""

import io
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_demo_shows_the_whole_loop_and_exits_0(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "canaryd", "demo", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "\r" not in p.stderr  # piped: no progress line
    said = " ".join(p.stdout.split())  # rich wraps long lines
    m = re.search(
        r"OK: baseline (\d+), identical on re-probe (\d+), drift after the silent shift (\d+) of (\d+)\.",
        said,
    )
    assert m, said[-2000:]
    baseline, identical, drift, total = map(int, m.groups())
    assert baseline == identical == total > 0 and 0 < drift <= total
    assert (tmp_path / "demo" / "state" / "canaryd.db").exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_training_the_demo_model_shows_its_steps_on_a_terminal(tmp_path):
    """The demo's longest silent stretch was training: its steps count on the progress line."""
    from canaryd.lab.tinymodel import build_tiny_model
    from canaryd.progress import shown

    term = _Terminal()
    with shown("training", "steps", stream=term):
        build_tiny_model(tmp_path / "model", seed=0, train=[("What is 2 + 2?", "4")], steps=3)
    drawn = term.getvalue()
    assert "training 1/3 steps on the tiny model" in drawn or "training 3/3 steps on the tiny model" in drawn
    assert drawn.endswith("\r")  # erased at the end: the tables start on a clean line
