"""Run a real vLLM OpenAI-compatible server as a subprocess.

canaryd probes *deployed* endpoints, so its tests and ``canaryd demo`` should
talk to the real server rather than a mock: only the real one shows the
exact JSON shapes, headers, metrics and numeric drift (dtype, quantisation)
that canaries are meant to detect.  The server runs in its own process group
so that ``stop()`` also reaps vLLM's engine-core child processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx2

from canaryd.lazy import user_environ


class VLLMServerError(RuntimeError):
    """The server exited or never became healthy; the message has its log tail."""


PORT_ATTEMPTS = 3  # starts on a new free port when another process took the one chosen
# The server's environment, unless the environment or the caller's `env` says otherwise.
# - One compute thread, left to the OS scheduler. vLLM's CPU default binds every server's thread to the same
#   core, so two busy servers on one machine (a fleet behind a balancer, tests in parallel) share that core
#   while the others idle: a two-server fleet answered about 4× slower. The thread count is vLLM's own
#   serving default; its CPU results do not depend on either setting.
# - The model runs in the engine-core process, not in a third one. On a CPU vLLM starts its processes by
#   `spawn`, each importing torch and vLLM anew (about 20 s here), so two processes start about 20 s sooner
#   than three, with the same answers.
DEFAULTS = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def free_port() -> int:
    """A loopback port that was free a moment ago (good enough for tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_block(
    name: str, port: int, *, model: str = "tiny", concurrency: int = 2, host_probe: bool = False
) -> str:
    """The ``[[backends]]`` block that probes a `VLLMServer` on ``port`` (the server's own kind); with
    ``host_probe`` canaryd also reads the server's host and process (it serves from this interpreter)."""
    block = (
        f'[[backends]]\nname = "{name}"\nkind = "vllm"\nbase_url = "http://127.0.0.1:{port}/v1"\n'
        f'model = "{model}"\nconcurrency = {concurrency}\n'
    )
    return block + (f"host_probe = {{ python = {json.dumps(sys.executable)} }}\n" if host_probe else "")


class VLLMServer:
    """``with VLLMServer(model_dir) as srv:`` serves the model at ``srv.base_url``."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        port: int | None = None,
        dtype: str = "float32",
        served_model_name: str = "tiny",
        api_key: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | str | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = port or free_port()
        self._chosen_port = port is None  # ours to choose again if another process takes it first
        self.dtype = dtype
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    @property
    def root_url(self) -> str:
        """Server root, where /health, /version, /metrics and /tokenize live."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI-style base URL (ends in /v1), as OpenAI clients expect."""
        return f"{self.root_url}/v1"

    def command(self) -> list[str]:
        """The argv used to launch the server (exposed for logging and tests)."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            "512",
            "--gpu-memory-utilization",
            "0.2",
            "--seed",
            "0",
        ]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + list(self.extra_args)

    def log_tail(self, n: int = 40) -> str:
        """Last ``n`` lines of the server log, for error messages."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def start(self) -> VLLMServer:
        """Launch the server and block until ``GET /health`` answers 200."""
        if self.proc is not None:
            raise VLLMServerError("server already started")
        # 1 GiB KV cache is plenty for a 512-token tiny model; the default
        # (a share of RAM) would crowd a small CI machine.
        env = {
            **DEFAULTS,
            **user_environ(),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **self.env,
        }
        t0 = time.monotonic()
        for attempt in range(PORT_ATTEMPTS):
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    self.command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            try:
                self._wait_healthy(t0 + self.startup_timeout)
                break
            except VLLMServerError:
                self.stop()
                # the free port was taken between `free_port` and vLLM's bind (another test's server)
                taken = "Address already in use" in self.log_tail()
                if not (taken and self._chosen_port and attempt + 1 < PORT_ATTEMPTS):
                    raise
                self.port = free_port()
            except BaseException:
                self.stop()  # never leak a half-started server, even on Ctrl-C
                raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        with httpx2.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise self._error(f"vLLM exited with code {self.proc.returncode} during start-up")
                try:
                    if client.get(f"{self.root_url}/health").status_code == 200:
                        return
                except httpx2.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise self._error(f"vLLM not healthy after {self.startup_timeout:.0f}s")
                time.sleep(0.5)

    def _error(self, why: str) -> VLLMServerError:
        return VLLMServerError(f"{why}; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        # Engine-core children can outlive the API process; kill the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
