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


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("api_key", True),
        ("admin_api_key", True),
        ("hf_token", True),
        ("HF_TOKEN", True),
        ("db.password", True),
        ("OPENAI_APIKEY", True),
        ("apiKey", True),
        ("ssl_keyfile", True),
        # where a credential is kept, or which one: dropped as the credential is
        ("api_key_env", True),
        ("password_file", True),
        ("secret_name", True),
        ("token_path", True),
        ("AWS_ACCESS_KEY_ID", True),
        # a credential with any other qualifier: the rule fails closed
        ("OPENAI_API_KEY_2", True),
        ("HF_TOKEN_1", True),
        ("API_KEY_PROD", True),
        ("PRIVATE_KEY_PEM", True),
        ("API_KEY_BASE64", True),
        ("GITHUB_TOKEN_READONLY", True),
        # a tokenizer's tokens, an attention key, counts: kept
        ("bos_token_id", False),
        ("eos_token_id", False),
        ("tokenizer.ggml.bos_token_id", False),
        ("tokenizer.ggml.token_type", False),
        ("bos_token", False),
        ("timings_per_token", False),
        ("speculative_token_map", False),
        ("VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD", False),
        ("llama.attention.key_length", False),
        ("token_ids", False),
        ("bucket_inter_token_latency", False),
        ("max_total_tokens", False),
        ("tokenizer_path", False),
        ("kv_cache_dtype", False),
        ("keep_mm_feature_on_device", False),
    ],
)
def test_credentials_are_known_by_their_name(name: str, secret: bool) -> None:
    assert hostfacts.is_secret_name(name) is secret


def test_credentials_in_urls_are_redacted() -> None:
    assert (
        hostfacts.redact_url("s3://u:pw@host/x and https://h/y") == "s3://<redacted>@host/x and https://h/y"
    )


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
