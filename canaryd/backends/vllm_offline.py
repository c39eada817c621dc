"""Kind ``vllm-offline``: canaries through an in-process ``vllm.LLM``, built with the exact engine args a
benchmark will use, so the stack an evaluator checks is the stack it runs.

Config (``[[backends]]``): ``model`` (path or hub id given to ``vllm.LLM``), ``engine`` (its keyword
arguments: dtype, quantization, kv_cache_dtype, enforce_eager, seed, max_model_len, …) and ``env``
(environment variables set before the engine starts: VLLM_BATCH_INVARIANT, VLLM_CPU_KVCACHE_SPACE, …).
``base_url``, keys and ``timeout_s`` do not apply (a generate call cannot be interrupted).

* The engine is built lazily, on the first ``snapshot``/``probe`` (so ``canaryd validate`` never starts
  one), and once per backend object; a failed start is retried on the next pass.
* Probes are **serialized** (one lock, ``concurrency`` forced to 1): every canary runs alone, at batch size
  1, so its logprobs never depend on which other canaries happened to share its batch. Canaries exist to
  measure the stack, not batch composition; a suite of 13 short canaries takes seconds anyway. The prefix
  cache is reset before each canary, so each is a cold prefill on every pass (a hit computes differently).
  One throw-away request after start-up keeps one-off set-up out of the first canary's latency.
* Tokens are keyed by id (``token_id:N``), like the ``vllm`` kind's ``return_tokens_as_token_ids``:
  vLLM decodes partial UTF-8 bytes as "", which would make different tokens look equal. ``top`` is the
  exact top-k by rank (the sampled token is included only if it ranks within k).
* The snapshot is the whole stack, taken once when the engine starts (the files hashed are the files
  loaded): host facts (`hostfacts`: python, os, cpu ISA, GPUs, packages, VLLM_* env, model file hashes),
  ``vllm.version``, torch build and devices, every numerics-relevant resolved engine setting
  (``engine.<config>.<field>`` read back from ``llm.llm_engine.vllm_config``) and the chat template's
  rendering (``template.*``, as for the ``vllm`` kind). Each observation adds
  ``response.system_fingerprint``, computed by vLLM's own ``vllm serve`` function.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import hashlib
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from canaryd.backends.base import BackendSettings, BackendUnavailable
from canaryd.backends.openai_request import request_hash
from canaryd.backends.openai_wire import InvalidResponse
from canaryd.backends.vllm_server import TEMPLATE_PROBE
from canaryd.canaries import Canary
from canaryd.lazy import Logger, lazy_import
from canaryd.observation import LOGPROB_MAX, ErrorKind, Observation, TokenLogprob, logprob_problem, utcnow

EXAMPLE = """\
# vLLM in-process: the exact engine a benchmark will use (whole-stack snapshot, batch size 1).
# [[backends]]
# name = "bench-stack"
# kind = "vllm-offline"
# model = "/models/llama-3-8b"              # path or id given to vllm.LLM
# engine = { dtype = "bfloat16", max_model_len = 4096, enforce_eager = true, seed = 0 }
# env = { VLLM_BATCH_INVARIANT = "1" }      # set before the engine starts
"""
ENGINE_VERSION_FIELD = "vllm.version"


class Settings(BackendSettings):
    kind: Literal["vllm-offline"] = "vllm-offline"
    # keyword arguments for vllm.LLM (dtype, quantization, kv_cache_dtype, enforce_eager, seed,
    # max_model_len, ...) and environment variables set before the engine starts (VLLM_BATCH_INVARIANT, ...)
    engine: dict[str, str | int | float | bool] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)


# Resolved engine settings that can change numerics (or the fingerprint), by VllmConfig section.
# Volatile ones (memory-derived block counts, ports, paths of caches) are left out on purpose.
ENGINE_FIELDS: dict[str, tuple[str, ...]] = {
    "model_config": (
        "model",
        "dtype",
        "quantization",
        "max_model_len",
        "seed",
        "enforce_eager",
        "revision",
        "tokenizer",
        "tokenizer_revision",
        "tokenizer_mode",
        "trust_remote_code",
        "hf_overrides",
        "logprobs_mode",
        "max_logprobs",
        "generation_config",
        "override_generation_config",
        "disable_cascade_attn",
        "use_fp64_gumbel",
        "runner_type",
    ),
    "cache_config": (
        "block_size",
        "cache_dtype",
        "enable_prefix_caching",
        "prefix_caching_hash_algo",
        "sliding_window",
        "kv_cache_dtype_skip_layers",
        "mamba_cache_dtype",
        "mamba_ssm_cache_dtype",
    ),
    "parallel_config": (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enable_expert_parallel",
        "disable_custom_all_reduce",
    ),
    "scheduler_config": (
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "async_scheduling",
        "policy",
        "long_prefill_token_threshold",
    ),
    "attention_config": ("backend", "flash_attn_version"),
    "compilation_config": ("mode", "cudagraph_mode", "backend", "custom_ops"),
    "speculative_config": ("method", "model", "num_speculative_tokens"),
    "device_config": ("device_type",),
    "load_config": ("load_format",),
}
hostfacts = lazy_import("canaryd.backends.hostfacts")  # a probe's, not a config check's
log = Logger("canaryd.vllm_offline")  # structlog, imported when it first logs
# Shown instead of the value for engine args and env vars whose names look like credentials.
REDACTED = "<redacted>"


def _text(value: Any) -> str:
    """One stable string per value: dtypes without ``torch.``, enums by name, containers as JSON."""
    if value is None:
        return ""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict | list | tuple | set):
        items = sorted(value, key=str) if isinstance(value, set) else value
        return json.dumps(items, sort_keys=True, default=str)
    text = str(value)
    return text.removeprefix("torch.") if type(value).__module__ == "torch" else text


def engine_facts(vllm_config: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for section, names in ENGINE_FIELDS.items():
        cfg = getattr(vllm_config, section, None)
        if cfg is None:
            out[f"engine.{section}"] = ""
            continue
        for name in names:
            if hasattr(cfg, name):
                out[f"engine.{section}.{name}"] = _text(getattr(cfg, name))
    return out


def system_fingerprint(vllm_config: Any) -> str | None:
    """What ``vllm serve`` (fingerprint mode ``full``) would send, by vLLM's own function."""
    try:
        from vllm.entrypoints.serve.utils.fingerprint import build_system_fingerprint
    except ImportError:
        try:
            from vllm.entrypoints.openai.fingerprint import build_system_fingerprint  # vLLM 0.21-0.28
        except ImportError:
            return None
    return build_system_fingerprint(vllm_config)


def torch_facts() -> dict[str, str]:
    import torch

    out = {
        "torch.version": str(torch.__version__),
        "torch.build.cuda": _text(torch.version.cuda),
        "torch.build.hip": _text(getattr(torch.version, "hip", None)),
        "torch.build.debug": str(bool(torch.version.debug)),
        "torch.build.git": str(getattr(torch.version, "git_version", "")),
        "torch.cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "torch.cxx11_abi": str(torch.compiled_with_cxx11_abi()),
        "torch.cuda_available": str(torch.cuda.is_available()),
    }
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        out["torch.devices.count"] = str(n)
        for i in range(n):
            out[f"torch.devices.{i}.name"] = torch.cuda.get_device_name(i)
            major, minor = torch.cuda.get_device_capability(i)
            out[f"torch.devices.{i}.capability"] = f"{major}.{minor}"
        out["torch.cudnn"] = _text(torch.backends.cudnn.version())
    return out


def _redact_args(args: dict[str, Any]) -> dict[str, Any]:
    return {k: (REDACTED if hostfacts.is_secret_name(k) else v) for k, v in args.items()}


class Prober:
    kind = "vllm-offline"

    def __init__(self, cfg: Settings) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.concurrency = 1  # probes are serialized anyway (see the module docstring)
        self._lock = threading.Lock()
        self._llm: Any = None
        self._stack: dict[str, str] | None = None
        self._fingerprint: str | None = None
        self.engine_start_s: float | None = None

    # -- the engine ---------------------------------------------------------------------------------
    def _chat_template(self) -> str | None:
        tpl = self.cfg.engine.get("chat_template")
        if not isinstance(tpl, str):
            return None
        path = Path(tpl).expanduser()
        return path.read_text(encoding="utf-8") if path.is_file() else tpl

    def _ensure(self) -> Any:
        """The engine, built on first use; the caller holds the lock."""
        if self._llm is not None:
            return self._llm
        os.environ.update(self.cfg.env)
        # vLLM logs to stdout by default, which would corrupt `--json` output.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        revision = self.cfg.engine.get("revision")
        facts = hostfacts.collect(  # the files hashed before they are loaded
            self.cfg.model,
            revision=revision if isinstance(revision, str) else None,
            process=False,
            hash_cache=hostfacts.default_hash_cache(),
        )
        import vllm

        t0 = time.perf_counter()
        llm = vllm.LLM(model=self.cfg.model, **self.cfg.engine)
        self.engine_start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._warm_up(llm)
        log.info(
            "engine_started",
            backend=self.name,
            seconds=round(self.engine_start_s, 1),
            warm_up_s=round(time.perf_counter() - t0, 1),
        )
        vllm_config = llm.llm_engine.vllm_config
        facts.update(torch_facts())
        facts.update(hostfacts.env_facts())  # after start-up: the platform sets some VLLM_* itself
        facts["vllm.version"] = str(vllm.__version__)
        facts.update(engine_facts(vllm_config))
        facts.update(self._template_facts(llm))
        self._fingerprint = system_fingerprint(vllm_config)
        self._stack = {"backend.kind": self.kind, "request.model": self.cfg.model, **facts}
        self._llm = llm
        return llm

    def _warm_up(self, llm: Any) -> None:
        """One throw-away chat request: the first request pays one-off set-up (seconds on CPU), which
        would otherwise land in the first canary's latency."""
        from vllm import SamplingParams

        warm = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1)
        llm.chat(TEMPLATE_PROBE, warm, use_tqdm=False, chat_template=self._chat_template())

    def _template_facts(self, llm: Any) -> dict[str, str]:
        try:
            ids = llm.get_tokenizer().apply_chat_template(
                TEMPLATE_PROBE, add_generation_prompt=True, tokenize=True, chat_template=self._chat_template()
            )
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            ids = [int(t) for t in ids]
        except Exception as e:
            return {"template.error": f"{e.__class__.__name__}: {str(e)[:200]}"}
        return {
            "template.tokens_sha256": hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16],
            "template.token_count": str(len(ids)),
        }

    def _start(self) -> Any:
        try:
            return self._ensure()
        except Exception as e:
            raise BackendUnavailable(
                ErrorKind.INTERNAL, f"vLLM engine failed to start: {e.__class__.__name__}: {str(e)[:300]}"
            ) from None

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            self._start()
            assert self._stack is not None
            return dict(self._stack)

    def close(self) -> None:
        with self._lock:
            llm, self._llm = self._llm, None
            if llm is None:
                return
            with contextlib.suppress(Exception):  # the engine process dies with us anyway
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

    # -- probing ------------------------------------------------------------------------------------
    def sampling(self, canary: Canary) -> dict[str, Any]:
        """Every sampling parameter, explicit: nothing falls back to generation_config.json."""
        d = canary.decoding
        return {
            "n": 1,
            "temperature": d.temperature,
            "top_p": d.top_p,
            "top_k": 0,  # vLLM 0.32: 0 disables top-k (-1 is accepted as an alias)
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "max_tokens": d.max_tokens,
            "seed": d.seed,
            "logprobs": d.top_logprobs,
            "stop": list(d.stop) if d.stop else None,
        }

    def _request(self, canary: Canary) -> tuple[dict, str]:
        """The request as recorded, and its hash over what the canary decides (model, input, sampling).

        Engine args and env are recorded but not hashed: a changed engine is a stack change to detect,
        whereas a changed request starts a new baseline.
        """
        core: dict[str, Any] = {"model": self.cfg.model, "sampling": self.sampling(canary)}
        if canary.messages is not None:
            core["messages"] = [m.model_dump() for m in canary.messages]
        else:
            core["prompt"] = canary.prompt
        body = {
            **core,
            "engine": _redact_args(dict(self.cfg.engine)),
            "env": _redact_args(dict(self.cfg.env)),
        }
        return body, request_hash(core)

    def request(self, canary: Canary) -> dict:
        return self._request(canary)[0]

    def request_hash(self, canary: Canary) -> str:
        return self._request(canary)[1]

    def attempt(self, canary: Canary) -> Observation:
        body, rhash = self._request(canary)
        obs = Observation(
            backend=self.name,
            canary_id=canary.id,
            suite=canary.suite,
            started_at=utcnow(),
            request=body,
            request_hash=rhash,
        )
        with self._lock:
            try:
                llm = self._start()
            except BackendUnavailable as e:
                obs.error_kind, obs.error = e.kind, str(e)
                return obs
            t0 = time.perf_counter()
            try:
                # Every canary is a cold prefill, as on the first pass after start-up: a prefix-cache hit
                # computes differently, and would make later passes drift from the baseline.
                llm.reset_prefix_cache()
                self._generate(llm, canary, body, obs)
            except InvalidResponse as e:  # the engine answered, with values no engine should produce
                obs.error_kind, obs.error, obs.tokens = ErrorKind.INVALID_RESPONSE, str(e), []
            except Exception as e:
                obs.error_kind = ErrorKind.INTERNAL
                obs.error = f"{e.__class__.__name__}: {str(e)[:300]}"
            obs.latency_s = time.perf_counter() - t0
        return obs

    def _generate(self, llm: Any, canary: Canary, body: dict, obs: Observation) -> None:
        from vllm import SamplingParams

        params = SamplingParams(**body["sampling"])
        if canary.messages is not None:
            outs = llm.chat(
                body["messages"],
                params,
                use_tqdm=False,
                add_generation_prompt=True,
                chat_template=self._chat_template(),
            )
        else:
            outs = llm.generate(body["prompt"], params, use_tqdm=False)
        out = outs[0]
        comp = out.outputs[0]
        obs.text = comp.text
        obs.finish_reason = comp.finish_reason
        obs.prompt_tokens = len(out.prompt_token_ids or ())
        obs.completion_tokens = len(comp.token_ids)
        obs.system_fingerprint = self._fingerprint
        obs.response_model = self.cfg.model
        obs.stack = {"response.system_fingerprint": str(self._fingerprint)}
        if comp.logprobs is None:
            obs.error_kind, obs.error = ErrorKind.NO_LOGPROBS, "engine returned no logprobs"
            return
        obs.tokens = token_logprobs(comp.token_ids, comp.logprobs, body["sampling"]["logprobs"])


def _key(token_id: int) -> str:
    return f"token_id:{token_id}"


def _logprob(value: Any, where: str) -> float:
    """A logprob as vLLM's server sends it: -inf (and anything below -9999) clamped at -9999, the server's
    floor for a token the sampler masked; NaN or a value above 0 is no logprob (`InvalidResponse`)."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidResponse(f"{where}: has type {type(value).__name__}") from None
    if math.isnan(v) or v > LOGPROB_MAX:
        raise InvalidResponse(f"{where}: {logprob_problem(v)}")
    return max(v, -9999.0)


def token_logprobs(token_ids: Any, steps: Any, k: int) -> list[TokenLogprob]:
    """vLLM's per-step ``{token_id: Logprob}`` as canaryd tokens (logprobs clamped like the server's).

    `InvalidResponse` (naming the step) when a logprob is NaN or above 0: the engine produced garbage."""
    tokens = []
    for i, (tid, step) in enumerate(zip(token_ids, steps, strict=True)):
        chosen = step[tid]
        ranked = sorted(
            ((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank is not None and lp.rank <= k),
        )
        decoded = chosen.decoded_token
        tokens.append(
            TokenLogprob(
                token=_key(tid),
                logprob=_logprob(chosen.logprob, f"outputs.0.logprobs.{i}.logprob"),
                token_id=int(tid),
                bytes=None if decoded is None else tuple(decoded.encode("utf-8", errors="replace")),
                top=tuple(
                    (_key(t), _logprob(lp, f"outputs.0.logprobs.{i}.top.{j}.logprob"))
                    for j, (_, t, lp) in enumerate(ranked)
                ),
            )
        )
    return tokens
