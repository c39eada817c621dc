"""A vLLM server's launch arguments and environment as ``engine.*``/``env.*`` (engine_args.py): parsing of
recorded command lines, the secrets kept out, and the ``/proc`` walk on a real process listening on a
port (a stand-in script named ``vllm``; the real vLLM server is tests/e2e/test_engine_args_vllm.py)."""

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from canaryd.backends import engine_args as ea
from canaryd.report.record import suggest
from canaryd.stack import diff

# Command lines as `ps`/`/proc/PID/cmdline` show them for the usual ways vLLM is started.
SERVE = ["/opt/vllm/bin/python3", "/opt/vllm/bin/vllm", "serve", "Qwen/Qwen3-8B", "--dtype", "bfloat16"]
MODULE = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--port", "8000"]
CLI_MAIN = ["python", "-m", "vllm.entrypoints.cli.main", "serve", "/m", "-tp", "2"]


@pytest.mark.parametrize(
    ("argv", "model"),
    [(SERVE, "Qwen/Qwen3-8B"), (MODULE, "/m"), (CLI_MAIN, "/m"), (["vllm", "serve", "--model", "/x"], "/x")],
)
def test_every_way_of_starting_vllm_names_the_model(argv, model):
    args = ea.vllm_args(argv)
    assert args is not None
    assert ea.parse_args(args)["model"] == model


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "-m", "sglang.launch_server", "--port", "1"],
        ["docker-proxy", "-host-port", "8000"],
        ["vllm"],
    ],
)
def test_other_programs_are_not_vllm(argv):
    assert ea.vllm_args(argv) is None


def test_flag_forms():
    args = ea.parse_args(
        [
            "--model",
            "/m",
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--max-model-len=4096",
            "--served-model-name",
            "a",
            "b",
            "-q",
            "fp8",
            "-tp",
            "2",
            "-O3",
            "--seed",
            "-1",
            "--kv_cache_dtype",
            "fp8_e5m2",
            "--dtype",
            "half",
            "--dtype",
            "bfloat16",
        ]
    )
    assert args == {
        "model": "/m",
        "enforce_eager": "true",
        "enable_prefix_caching": "false",
        "max_model_len": "4096",
        "served_model_name": "a b",
        "quantization": "fp8",
        "tensor_parallel_size": "2",
        "optimization_level": "3",
        "seed": "-1",
        "kv_cache_dtype": "fp8_e5m2",
        "dtype": "bfloat16",  # the last one wins, as in argparse
    }


def test_secrets_are_redacted_and_volatile_arguments_left_out():
    secret = "sk-engine-args-secret-1"
    args = ea.parse_args(
        [
            "--model",
            "/m",
            "--api-key",
            secret,
            f"--hf-token={secret}x",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--uvicorn-log-level",
            "debug",
            "--disable-log-requests",
            "--kv-transfer-config",
            '{"kv_role": "kv_both", "auth": {"api_key": "hidden-2"}, "note": "' + secret + '"}',
            "--middleware",
            "https://user:pw-3@proxy.example/x",
        ]
    )
    fields = ea.engine_fields(args)
    assert fields == {
        "engine.api_key": "<redacted>",
        "engine.hf_token": "<redacted>",
        "engine.kv_transfer_config": '{"auth":{"api_key":"<redacted>"},"kv_role":"kv_both",'
        '"note":"<redacted>"}',
        "engine.middleware": "https://<redacted>@proxy.example/x",
        "engine.model": "/m",
    }
    for leaked in (secret, "hidden-2", "pw-3"):
        assert leaked not in repr(fields)


def test_each_of_several_keys_is_kept_out_of_other_values():
    fields = ea.engine_fields({"api_key": "key-one key-two", "middleware": "m?k=key-two"})
    assert fields == {"engine.api_key": "<redacted>", "engine.middleware": "m?k=<redacted>"}


def test_json_values_are_canonical():
    a = ea.engine_fields({"compilation_config": '{"level": 3, "cudagraph_mode": "NONE"}'})
    b = ea.engine_fields({"compilation_config": '{"cudagraph_mode":"NONE","level":3}'})
    assert a == b == {"engine.compilation_config": '{"cudagraph_mode":"NONE","level":3}'}


def test_environ_keeps_numerics_and_drops_secrets():
    raw = b"HOME=/root\0VLLM_CPU_KVCACHE_SPACE=1\0VLLM_API_KEY=s1\0HF_TOKEN=s2\0VLLM_BATCH_INVARIANT=1\0"
    env = ea.parse_environ(raw)
    assert env["VLLM_API_KEY"] == "s1"
    from canaryd.backends.hostfacts import env_facts

    assert env_facts(env) == {"env.VLLM_BATCH_INVARIANT": "1", "env.VLLM_CPU_KVCACHE_SPACE": "1"}


def test_the_names_vllm_draws_on_every_start_are_not_stack_facts():
    """An engine in canaryd's process (vllm-offline with VLLM_ENABLE_V1_MULTIPROCESSING=0) sets these in
    canaryd's own environment, new on every start: recorded, every check was a stack change."""
    from canaryd.backends.hostfacts import env_facts

    started = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_DIST_IDENT": "vllm_dist_fc29114e379f4d5aa516e429a5b2fd88",
        "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": "vllm_mm_0589CKEfRQKn0xz3BMMCZg",
    }
    assert env_facts(started) == {"env.VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100007F:1F40 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 222 1
   2: 00000000:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1
"""


def test_listening_inodes_only_listeners_on_the_port():
    assert ea.listening_inodes([TCP], 8000) == {"111"}  # 0x1F40; the established 222 is not a listener
    assert ea.listening_inodes([TCP], 8001) == {"333"}
    assert ea.listening_inodes([TCP], 9) == set()


def test_dtype_switch_is_ranked_before_the_cache_sizes_it_implies():
    before = {"engine.dtype": "float32", "metrics.vllm:cache_config_info.num_cpu_blocks": "100"}
    after = {"engine.dtype": "bfloat16", "metrics.vllm:cache_config_info.num_cpu_blocks": "200"}
    advice = suggest(diff(before, after))
    assert advice.index("1. engine.dtype (float32 -> bfloat16)") < advice.index("2. metrics.")


def test_nothing_listening_is_an_error_field():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        assert ea.server_facts(port) == {"engine.error": f"no process listens on port {port} on this host"}


def test_a_process_that_is_not_vllm_is_named_not_parsed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        facts = ea.server_facts(port)  # this test process (named by its command line: xdist retitles it)
    assert list(facts) == ["engine.error"]
    assert facts["engine.error"].startswith(f"the process listening on port {port} is not a vLLM server: ")


STAND_IN = """\
import socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
s = socket.socket(socket.AF_INET6)
s.bind(("::1", port)); s.listen()
print("ready", flush=True)
time.sleep(30)
"""


def test_a_real_process_on_the_port_gives_its_arguments_and_environment(tmp_path: Path):
    script = tmp_path / "vllm"
    script.write_text(textwrap.dedent(STAND_IN))
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, str(script), "serve", "/models/tiny", "--dtype", "float32", "--enforce-eager"]
    argv += ["--port", str(port), "--api-key", "sk-stand-in-secret"]
    env = {"PATH": os.environ["PATH"], "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": "sk-stand-in-secret"}
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        t0 = time.perf_counter()
        facts = ea.server_facts(port)
        elapsed = time.perf_counter() - t0
    finally:
        p.kill()
        p.wait()
    assert facts == {
        "engine.model": "/models/tiny",
        "engine.dtype": "float32",
        "engine.enforce_eager": "true",
        "engine.api_key": "<redacted>",
        "env.VLLM_CPU_KVCACHE_SPACE": "1",
    }
    assert elapsed < 1.0
