"""Kind ``vllm-offline`` without an engine: its token logprobs, request hash and engine facts, from
stand-ins of vLLM's objects. The real engine (``python -m canaryd check`` on an in-process ``vllm.LLM``) is
in tests/e2e/test_vllm_offline.py.
"""

from types import SimpleNamespace

from canaryd.backends import make_backend
from canaryd.backends.vllm_offline import Prober, Settings, engine_facts, token_logprobs
from canaryd.canaries import load_suites

SUITE = """
[suite]
name = "offline"
[defaults]
max_tokens = 8
[[canary]]
id = "chat-add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
[[canary]]
id = "chat-capital"
messages = [{ role = "system", content = "Be brief." }, { role = "user", content = "Capital of France?" }]
decoding = { top_logprobs = 3, stop = ["\\n"] }
[[canary]]
id = "raw-completion"
prompt = "The three primary colors of light are"
decoding = { max_tokens = 4 }
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "offline"
kind = "vllm-offline"
model = "{model}"
engine = {{ {engine} }}
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", VLLM_ENABLE_V1_MULTIPROCESSING = "0" }}
"""
ENGINE = {"dtype": '"float32"', "max_model_len": "512", "enforce_eager": "true", "seed": "0"}


def lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token="")


def test_tokens_are_keyed_by_id_and_top_is_the_exact_top_k():
    # vLLM puts the sampled token first, then the ranked top-k; "" is a partial UTF-8 byte
    steps = [
        {7: lp(-0.1, 1), 9: lp(-2.5, 2), 4: lp(-3.0, 3)},
        {5: lp(-4.0, 4), 1: lp(-0.5, 1), 2: lp(-1.0, 2)},  # sampled outside the top 2
        {3: lp(float("-inf"), 9), 8: lp(-0.01, 1), 6: lp(-7.0, 2)},
    ]
    tokens = token_logprobs([7, 5, 3], steps, k=2)
    assert [t.token for t in tokens] == ["token_id:7", "token_id:5", "token_id:3"]
    assert [t.token_id for t in tokens] == [7, 5, 3]
    assert tokens[0].top == (("token_id:7", -0.1), ("token_id:9", -2.5))
    assert tokens[1].top == (("token_id:1", -0.5), ("token_id:2", -1.0))
    assert tokens[2].logprob == -9999.0 and tokens[2].bytes == ()
    assert token_logprobs([7], steps[:1], k=0)[0].top == ()


def test_request_hash_covers_the_canary_not_the_engine(tmp_path):
    (tmp_path / "s.toml").write_text(SUITE)
    canaries = {c.id: c for s in load_suites([tmp_path / "s.toml"]) for c in s.canaries}

    def backend(**engine) -> Prober:
        cfg = Settings(name="o", kind="vllm-offline", model="/m", engine=engine, env={"VLLM_X": "1"})
        b = make_backend(cfg).prober  # through the registry
        assert isinstance(b, Prober) and b._llm is None  # nothing started before use
        return b

    f32, bf16 = backend(dtype="float32"), backend(dtype="bfloat16", hf_token="hf_secret")
    body32, hash32 = f32.request(canaries["chat-capital"]), f32.request_hash(canaries["chat-capital"])
    body16, hash16 = bf16.request(canaries["chat-capital"]), bf16.request_hash(canaries["chat-capital"])
    assert hash32 == hash16  # a changed engine is a stack change, not a new baseline
    assert body32["engine"] == {"dtype": "float32"} and body16["engine"]["hf_token"] == "<redacted>"
    assert body32["sampling"] == {
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "seed": 0,
        "logprobs": 3,
        "stop": ["\n"],
    }
    assert body32["messages"][0] == {"role": "system", "content": "Be brief."}
    assert f32.request_hash(canaries["raw-completion"]) != hash32
    assert f32.concurrency == 1


def test_engine_facts_stringify_resolved_settings():
    import enum

    class Mode(enum.Enum):
        NONE = 0

    cfg = SimpleNamespace(
        model_config=SimpleNamespace(dtype="float32", seed=0, enforce_eager=True, quantization=None),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16, num_gpu_blocks=1234),
        compilation_config=SimpleNamespace(mode=Mode.NONE, custom_ops=["none", "+rms_norm"]),
    )
    facts = engine_facts(cfg)
    assert facts["engine.model_config.dtype"] == "float32"
    assert facts["engine.model_config.quantization"] == ""
    assert facts["engine.model_config.enforce_eager"] == "True"
    assert facts["engine.compilation_config.mode"] == "NONE"
    assert facts["engine.compilation_config.custom_ops"] == '["none", "+rms_norm"]'
    assert "engine.cache_config.num_gpu_blocks" not in facts  # memory-derived: volatile
    assert facts["engine.speculative_config"] == ""
