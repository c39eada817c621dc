"""Host facts without a model or a serving venv: which environment variables the stdlib-only script
keeps, and how the vLLM server backend's host probe reports an interpreter that cannot run it.

The script itself, run under this venv's interpreter on a real (tiny) model, and the probe merging its
``host.*`` fields, are in tests/e2e/test_hostfacts.py.
"""

from pathlib import Path

import pytest

from canaryd.backends import hostfacts
from canaryd.backends.vllm_server import HostProbe, Prober, Settings


def test_secret_looking_names_are_dropped():
    env = {
        "VLLM_API_KEY": "x",
        "VLLM_KEY_FILE": "x",
        "VLLM_HF_TOKEN": "x",
        "VLLM_S3_SECRET_ACCESS": "x",
        "VLLM_DB_PASSWORD": "x",
        "VLLM_USE_CREDENTIALS": "x",
        "VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": "256",
        "VLLM_USE_FASTOKENS": "1",
        "VLLM_ENABLE_PREGRAD_PASSES": "1",
        "HOME": "/root",
    }
    assert hostfacts.env_facts(env) == {
        "env.VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": "256",
        "env.VLLM_USE_FASTOKENS": "1",
        "env.VLLM_ENABLE_PREGRAD_PASSES": "1",
    }


def server_backend(python: Path | str, model_dir: Path | None = None) -> Prober:
    cfg = Settings(
        name="local",
        kind="vllm",
        base_url="http://127.0.0.1:9/v1",
        model="tiny",
        host_probe=HostProbe(python=Path(python), model_dir=model_dir),
    )
    return Prober(cfg)


@pytest.mark.parametrize(
    ("python", "expected"),
    [
        ("/nonexistent/bin/python", "cannot run /nonexistent/bin/python: No such file or directory"),
        ("/bin/false", "host probe exited 1: "),
        ("/bin/echo", "host probe output is not JSON"),
    ],
)
def test_a_broken_interpreter_becomes_a_host_error_field(python, expected):
    backend = server_backend(python)
    assert backend._host_facts("/nowhere") == {"host.error": expected}
