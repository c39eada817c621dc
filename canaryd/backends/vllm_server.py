"""Kind ``vllm``: a vLLM OpenAI-compatible server, which tells much more about itself than a cloud API.

vLLM's ``system_fingerprint`` ignores the seed, enforce-eager, prefix caching and batch-invariant mode
and names no GPU, so an unchanged fingerprint is not an unchanged stack. The snapshot therefore also
reads ``/version``, ``/v1/models``, every ``*_info`` series on ``/metrics`` (their labels carry the
cache config: kv-cache dtype, block size, number of blocks — a proxy for memory and hardware) and the
token ids ``/tokenize`` gives a fixed chat, which moves when the tokenizer or chat template does.
``request.scoring_cache_salt = per-request`` records that scoring requests (forced canaries, reference
checks) carry a fresh ``cache_salt`` each, so a cached prefix never enters a score (`scoring.py`).

What no endpoint shows (GPU, driver, torch build, installed packages, weight file hashes) the optional
**host probe** adds when canaryd runs on the server's host: ``host_probe = { python =
"/opt/vllm/bin/python", model_dir = "/models/x" }`` runs ``hostfacts.py`` (beside this module) under the
serving venv's interpreter (isolated, stdlib only) and merges its fields as ``host.*``. ``model_dir``
defaults to ``/v1/models``' ``root``; file hashes are cached (by inode, size and change times) under the
user's cache directory. A failure (missing interpreter, timeout, bad output) becomes one ``host.error``
field, never an exception. With the host probe canaryd also reads the server process itself, the one
listening on ``base_url``'s port (`engine_args.py`): its launch arguments as ``engine.*`` (``engine.dtype``,
``engine.enforce_eager`` …, secrets redacted) and its numerics-relevant environment as ``env.*``, the
causes `explain` names before the cache sizes they imply. Off by default.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from canaryd.backends import engine_args, openai_compat, refusals, scoring
from canaryd.backends import openai_wire as wire
from canaryd.backends.base import HttpSettings
from canaryd.backends.engine_info import section
from canaryd.canaries import Canary
from canaryd.fields import Strict
from canaryd.lazy import lazy_import
from canaryd.observation import ErrorKind, Observation, storable, utcnow

httpx2 = lazy_import("httpx2")
transport = lazy_import("canaryd.backends.transport")

# A fixed conversation whose rendering is hashed: any tokenizer or chat-template change moves it.
TEMPLATE_PROBE = [
    {"role": "system", "content": "You are a canary."},
    {"role": "user", "content": "Say OK."},
]
_INFO_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*_info)\{(.*)\}\s+\S+$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
# Labels of *_info series that change without the stack changing.
_VOLATILE_LABELS = {"engine"}
HOSTFACTS_SCRIPT = Path(__file__).resolve().with_name("hostfacts.py")
# Generous: the first run hashes the weights (GBs); the hash cache keeps what it finished, even on timeout.
HOST_PROBE_TIMEOUT_S = 600.0


class _Refused(Exception):
    """A scoring call answered with an error status, classified as a probe's would be."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def info_series(metrics_text: str) -> dict[str, str]:
    """Label sets of every ``*_info`` series in a Prometheus exposition, flattened to dotted keys."""
    out: dict[str, str] = {}
    for line in metrics_text.splitlines():
        m = _INFO_LINE.match(line)
        if not m:
            continue
        for label, value in _LABEL.findall(m.group(2)):
            if label not in _VOLATILE_LABELS:
                out[f"metrics.{m.group(1)}.{label}"] = value.replace('\\"', '"').replace("\\\\", "\\")
    return out


EXAMPLE = """\
# A vLLM OpenAI-compatible server. canaryd also reads /version, /v1/models, /metrics and /tokenize
# to snapshot the serving stack.
[[backends]]
name = "local-vllm"
kind = "vllm"
base_url = "http://127.0.0.1:8000/v1"
model = "my-model"          # the served model name
# api_key_env = "VLLM_API_KEY" # if the server was started with --api-key
timeout_s = 60               # per request
concurrency = 4              # canaries in flight at once on this backend
# host_probe = { python = "/opt/vllm/bin/python" }  # canaryd on the server's host: its launch arguments
#                                                   # (engine.*), environment, packages, GPU and weights
"""
ENGINE_VERSION_FIELD = "vllm.version"


class HostProbe(Strict):
    """Facts about a vLLM server's host, gathered when canaryd runs on that host (off by default)."""

    python: Path  # the serving venv's interpreter, e.g. /opt/vllm/bin/python
    model_dir: Path | None = None  # weights directory to hash (default: the server's /v1/models root)


class Settings(HttpSettings):
    kind: Literal["vllm"] = "vllm"
    host_probe: HostProbe | None = None

    @property
    def scores(self) -> bool:
        return True  # prompt_logprobs: forced canaries and reference checks (`scoring.py`)


class Prober(openai_compat.Prober):
    kind = "vllm"
    cfg: Settings

    @property
    def root(self) -> str:
        return self.cfg.base_url.removesuffix("/v1")

    def extra_params(self, canary: Canary) -> dict:
        # vLLM fills unspecified sampling params from the model's generation_config.json: pin them all.
        # Tokens come back as "token_id:N": vLLM renders partial UTF-8 byte tokens as "", which would make
        # different tokens (and top-k alternatives) look equal.
        return {
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }

    def request(self, canary: Canary) -> dict:
        if canary.continuation is not None:
            return scoring.score_request(self.cfg.model, self._capped(canary))
        return super().request(canary)

    def _capped(self, canary: Canary) -> Canary:
        """The canary as scored: its top-k within the profile's ``top_logprobs``, as a generation's is
        (a server started with ``--max-logprobs`` refuses ``prompt_logprobs`` above it too). The baseline
        key stays the canary's own, as for every profile key."""
        k = min(canary.decoding.top_logprobs, self.profile.top_logprobs)
        if k == canary.decoding.top_logprobs:
            return canary
        return canary.model_copy(update={"decoding": canary.decoding.model_copy(update={"top_logprobs": k})})

    def request_hash(self, canary: Canary) -> str:
        if canary.continuation is not None:
            return scoring.score_hash(self.cfg.model, canary)
        return super().request_hash(canary)

    def attempt(self, canary: Canary) -> Observation:
        if canary.continuation is None:
            return super().attempt(canary)
        obs = Observation(
            self.name, canary.id, canary.suite, utcnow(), self.request(canary), self.request_hash(canary)
        )
        t0 = time.perf_counter()
        try:
            self._score(canary, obs)
        except _Refused as e:
            obs.error_kind, obs.error = e.kind, storable(self.redact(e.message))
        except (wire.InvalidResponse, transport.BadEncoding) as e:
            obs.error_kind, obs.error = ErrorKind.INVALID_RESPONSE, str(e)
        except transport.DeadlinePassed as e:
            obs.error_kind, obs.error = ErrorKind.TIMEOUT, str(e)
        except transport.TooLarge as e:
            obs.error_kind, obs.error = ErrorKind.TOO_LARGE, str(e)
        except httpx2.TransportError as e:
            obs.error_kind = openai_compat.transport_kind(e)
            obs.error = storable(self.redact(f"{e.__class__.__name__}: {str(e)[:300] or 'no detail'}"))
        obs.latency_s = time.perf_counter() - t0
        if obs.error is not None:
            obs.tokens = []
        return obs

    def _score(self, canary: Canary, obs: Observation) -> None:
        """Tokenize prompt and continuation, then score them in one prefill (`scoring.py`)."""
        model, k = self.cfg.model, self._capped(canary).decoding.top_logprobs
        prompt = scoring.token_ids(
            self._post(f"{self.root}/tokenize", scoring.tokenize_prompt(model, canary)), "prompt"
        )
        tail = scoring.token_ids(
            self._post(f"{self.root}/tokenize", scoring.tokenize_continuation(model, canary)), "continuation"
        )
        if not tail:
            raise wire.InvalidResponse("/tokenize (continuation): no tokens")
        ids = prompt + tail
        salted = scoring.completion_body(model, ids, k, scoring.cache_salt())
        body = self._post(f"{self.cfg.base_url}/completions", salted)
        obs.tokens = scoring.scored_tokens(body, ids, len(prompt), k)
        obs.text, obs.finish_reason = canary.continuation, "forced"
        obs.prompt_tokens, obs.completion_tokens = len(prompt), len(tail)
        if isinstance(body, dict):
            obs.response_model = body.get("model") if isinstance(body.get("model"), str) else None
            fp = body.get("system_fingerprint")
            obs.system_fingerprint = fp if isinstance(fp, str) else None
        obs.stack = {
            "response.model": str(obs.response_model),
            "response.system_fingerprint": str(obs.system_fingerprint),
        }

    def _post(self, url: str, body: dict) -> object:
        reply = self.exchange("POST", url, content=openai_compat.wire_body(body), headers=openai_compat.JSON)
        if not 200 <= reply.status < 300:
            raise _Refused(*refusals.classify(reply.status, reply.text, self.name))
        return wire.parse_json(reply.body)

    def snapshot(self) -> dict[str, str]:
        fields = super().snapshot()
        fields.update(scoring.SALTED)  # forced canaries and reference checks never read a cached prefix
        fields.update(section("vllm", self._version))
        fields.update(section("models", self._models))
        fields.update(section("metrics", self._metrics))
        fields.update(section("template", self._template))
        if self.cfg.host_probe is not None:
            fields.update(self._host_facts(fields.get("models.root")))
            fields.update(engine_args.server_facts(self.port))
        return fields

    @property
    def port(self) -> int:
        url = urlsplit(self.cfg.base_url)
        return url.port or (443 if url.scheme == "https" else 80)

    def _host_facts(self, model_root: str | None = None) -> dict[str, str]:
        """``hostfacts.py`` under the serving interpreter, prefixed ``host.``; never raises."""
        from canaryd.backends.hostfacts import default_hash_cache

        probe = self.cfg.host_probe
        assert probe is not None
        cmd = [str(probe.python), "-I", str(HOSTFACTS_SCRIPT), "--no-process-facts"]
        cmd += ["--hash-cache", str(default_hash_cache())]
        model_dir = probe.model_dir or model_root
        if model_dir and model_dir != "None":
            cmd += ["--model-dir", str(model_dir)]
        try:
            p = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=HOST_PROBE_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"host.error": f"host probe timed out after {HOST_PROBE_TIMEOUT_S:g}s"}
        except OSError as e:
            return {"host.error": f"cannot run {probe.python}: {e.strerror or e.__class__.__name__}"}
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or [""])[-1][:200]
            return {"host.error": f"host probe exited {p.returncode}: {last}"}
        try:
            facts = json.loads(p.stdout)
        except ValueError:
            return {"host.error": "host probe output is not JSON"}
        if not isinstance(facts, dict):
            return {"host.error": "host probe output is not a JSON object"}
        return {f"host.{k}": str(v) for k, v in facts.items()}

    def _version(self) -> dict[str, str]:
        return {"vllm.version": str(self.call("GET", f"{self.root}/version").json()["version"])}

    def _models(self) -> dict[str, str]:
        cards = self.call("GET", f"{self.cfg.base_url}/models").json()["data"]
        out = {"models.served": ",".join(sorted(str(c["id"]) for c in cards))}
        for card in cards:
            if card["id"] == self.cfg.model:
                for key in ("root", "parent", "max_model_len", "owned_by"):
                    out[f"models.{key}"] = str(card.get(key))
        return out

    def _metrics(self) -> dict[str, str]:
        return info_series(self.call("GET", f"{self.root}/metrics").text)

    def _template(self) -> dict[str, str]:
        r = self.call(
            "POST",
            f"{self.root}/tokenize",
            json={"model": self.cfg.model, "messages": TEMPLATE_PROBE, "add_generation_prompt": True},
        ).json()
        ids = [int(t) for t in r["tokens"]]
        return {
            "template.tokens_sha256": hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16],
            "template.token_count": str(len(ids)),
        }
