"""Pin, check --pin, preflight and explain against a real vLLM (CPU) server whose stack moves by a dtype
restart: the reproducibility record as an evaluator would use it around a benchmark session.
"""

import json
import sqlite3
import subprocess
import sys

import pytest

from canaryd.lab.vllm_process import VLLMServer, free_port
from canaryd.report.pin import load_pin, to_json
from canaryd.store import Store

pytestmark = pytest.mark.vllm
SUITE = """
[suite]
name = "t"
[defaults]
max_tokens = 8
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "raw"
prompt = "The three primary colors of light are"
"""


def test_pin_preflight_and_explain_around_a_silent_dtype_change(tmp_path, tiny_model):
    port = free_port()
    (tmp_path / "suite.toml").write_text(SUITE)
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(
        f"state_dir = 'state'\nsuites = ['suite.toml']\n[[backends]]\nname = 'local'\nkind = 'vllm'\n"
        f"base_url = 'http://127.0.0.1:{port}/v1'\nmodel = 'tiny'\ntimeout_s = 30\n"
    )
    pin, out, marker = tmp_path / "pin.json", tmp_path / "out", tmp_path / "marker"
    bench = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ran'); raise SystemExit(7)"]

    def canaryd(*args: str) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(cfg), *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert "Traceback" not in p.stderr, p.stderr
        return p

    def serve(dtype: str) -> VLLMServer:
        return VLLMServer(
            tiny_model,
            port=port,
            dtype=dtype,
            extra_args=["--enforce-eager"],
            log_path=tmp_path / f"vllm-{dtype}.log",
        )

    with serve("float32"):
        assert canaryd("pin", "--out", str(pin)).returncode == 0
        text = pin.read_text()
        p = load_pin(pin)
        fields = p.backends["local"].fields
        assert text == to_json(p)  # canonical: sorted keys, one field per line, so a diff names the field
        assert fields["vllm.version"] == "0.32.0" and fields["response.system_fingerprint"].startswith(
            "vllm-"
        )
        pinned_fp = fields["response.system_fingerprint"]
        ok = canaryd("check", "--pin", str(pin))
        assert ok.returncode == 0 and "matches" in ok.stdout, ok.stdout

        ran = canaryd("preflight", "--pin", str(pin), "--out", str(out), *bench)
        assert ran.returncode == 7 and marker.read_text() == "ran", ran.stderr
        rec = json.loads((out / "canaryd-record.json").read_text())
        assert rec["command"]["exit_code"] == 7 and rec["pin"]["matches"] is True
        assert rec["post_run"]["held"] is True and rec["post_run"]["verdicts"] == {"identical": 2}
        assert {c["verdict"] for c in rec["canaries"]} == {"identical"} and rec["changes"] == []
        store = Store(f"sqlite:///{tmp_path / 'state' / 'canaryd.db'}")
        for c in rec["canaries"]:
            stored = next(
                r
                for r in store.observations(canary_id=c["canary"], limit=1000)
                if r.id == c["observation_id"]
            )
            assert (stored.run_id, stored.verdict, stored.text) == (c["run_id"], c["verdict"], c["text"])
        stacks = {s.hash: s.fields for s in store.stacks("local")}
        assert rec["stack"]["local"]["fields"] == stacks[rec["storage"]["stack_hashes"][0]]
        store.close()
        md = (out / "canaryd-record.md").read_text()
        for line in (
            "1. **Whole stack:**",
            "2. **Pin:** matches",
            "3. **Canaries:** 2 run: 2 identical",
            "4. **",
            "5. **",
        ):
            assert line in md
        kept = (
            sqlite3.connect(tmp_path / "state" / "canaryd.db")
            .execute("select observation_id from keep where reason = 'preflight'")
            .fetchall()
        )
        assert {k for (k,) in kept} >= set(rec["storage"]["observation_ids"])

    marker.unlink()
    with serve("bfloat16"):  # same weights, same name: the silent shift
        refused = canaryd("preflight", "--pin", str(pin), "--out", str(tmp_path / "out2"), *bench)
        assert refused.returncode == 1 and not marker.exists()
        assert "not starting" in refused.stderr and "response.system_fingerprint" in refused.stderr
        assert not (tmp_path / "out2").exists()

        why = json.loads(canaryd("explain", "local", "add", "--json").stdout)
        assert "response.system_fingerprint" in json.dumps(why)

        # accepting the shift satisfies the baselines, never the pin
        assert canaryd("baseline", "accept").returncode == 0
        assert canaryd("check").returncode == 0
        moved = canaryd("check", "--pin", str(pin), "--json")
        assert moved.returncode == 1
        report = json.loads(moved.stdout)["pin"]
        assert report["matches"] is False
        fp = [m for m in report["moved"] if m["field"] == "response.system_fingerprint"]
        assert fp and fp[0]["pinned"] == pinned_fp and fp[0]["now"] != pinned_fp
