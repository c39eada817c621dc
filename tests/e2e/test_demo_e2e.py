"""The README's first command, `canaryd demo`, end to end: a tiny model trained on the spot, a real vLLM (CPU)
server, probe → baseline → identical re-probe → silent bfloat16 restart → drift verdict, exit 0."""

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
    said = " ".join(p.stdout.split())  # rich wraps long lines
    m = re.search(
        r"OK: baseline (\d+), identical on re-probe (\d+), drift after the silent shift (\d+) of (\d+)\.",
        said,
    )
    assert m, said[-2000:]
    baseline, identical, drift, total = map(int, m.groups())
    assert baseline == identical == total > 0 and 0 < drift <= total
    assert (tmp_path / "demo" / "state" / "canaryd.db").exists()
