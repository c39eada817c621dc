"""The test bed the end-to-end tests share: a suite and a config in a folder, a port for one vLLM server, and
the canaryd CLI run against them in a subprocess, as an operator runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from canaryd.lab.vllm_process import VLLMServer, free_port

# One vLLM backend named "local" on the lab's port: the config the suites need when they need nothing else.
LOCAL_CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "local"
kind = "vllm"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 60
"""


class Lab:
    """``config`` may name ``{port}``: the port `serve` starts vLLM on."""

    def __init__(
        self, root: Path, suite: str, config: str = LOCAL_CONFIG, env: dict[str, str] | None = None
    ) -> None:
        self.root = root
        self.port = free_port()
        self.env = env or {}
        (root / "suite.toml").write_text(suite)
        (root / "canaryd.toml").write_text(config.format(port=self.port))
        self.serving = root / "serving"  # a symlink, so swapped weights keep the same served path

    def serve(
        self, model: Path, dtype: str = "float32", *, link: bool = True, extra_args=(), **kwargs
    ) -> VLLMServer:
        """vLLM serving ``model`` (not started yet: use it as a context manager). ``link``: through the
        ``serving`` symlink, so that a swap of weights keeps every other engine argument as it was."""
        if link:
            self.serving.unlink(missing_ok=True)
            self.serving.symlink_to(model)
        return VLLMServer(
            self.serving if link else model,
            port=self.port,
            dtype=dtype,
            # --enforce-eager skips the torch.compile warm-up: ~35 s a start instead of ~50
            extra_args=["--enforce-eager", *extra_args],
            log_path=self.root / f"vllm-{model.name}-{dtype}.log",
            **kwargs,
        )

    def cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(self.root / "canaryd.toml"), *args],
            capture_output=True,
            text=True,
            env={**os.environ, **self.env, **(env or {})},
            timeout=600,
        )

    def json(self, *args: str) -> tuple[int, dict]:
        """Exit code and parsed stdout of ``canaryd ARGS --json`` (which must not crash)."""
        p = self.cli(*args, "--json")
        assert "Traceback" not in p.stderr, p.stderr
        return p.returncode, json.loads(p.stdout)
