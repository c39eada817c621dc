#!/usr/bin/env python3
"""Facts about the host a model runs on, as a flat ``dict[str, str]``: stdlib only, no canaryd import.

This file is also a standalone script, so canaryd can run it under *another* interpreter (a vLLM
server's venv) and learn what that venv holds::

    python -I canaryd/backends/hostfacts.py [--model-dir DIR] [--hash-cache FILE] [--no-process-facts]

prints one JSON object. Fields (absent when not applicable, ``<section>.error`` when a section failed):

``python.*``         version, implementation
``os.*``             system, kernel, machine, libc, id/version_id/pretty_name (/etc/os-release)
``cpu.*``            model, count, isa_flags (the SIMD/matrix extensions kernels dispatch on)
``gpu.nvidia.*``     driver_version, cuda_version, count, ``<i>.name/memory_mib/compute_cap`` (nvidia-smi)
``gpu.rocm.*``       what ``rocm-smi --json`` says about product and driver
``packages.<dist>``  versions of installed engine-relevant distributions (vllm*, torch*, triton, nvidia-*, …)
``torch.*``          version and build (cuda, hip, debug, git) from ``torch/version.py``, not importing torch
``env.<NAME>``       numerics-relevant environment (VLLM_*, CUBLAS_*, NCCL_*, …); names that look like
                     secrets are dropped; process facts, skipped with ``--no-process-facts``
``model.*``          ``files.<relpath>`` sha256 of every weight, config, tokenizer and template file,
                     ``chat_template_sha256`` (the effective template), ``revision`` (hub snapshot)

Hashes are cached by (device, inode, size, mtime, ctime) in memory and, with ``--hash-cache``, in a JSON
file written after each file, so multi-GB weights are read once, and an interrupted run keeps its work.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata, util
from pathlib import Path

# ISA extensions that change which kernels run (x86 /proc/cpuinfo "flags", Arm "Features").
_ISA = re.compile(
    r"^(sse4_[12]|ssse3|fma|f16c|avx\w*|amx\w*|asimd\w*|sve\w*|sme\d*|sme[fi]\w*|bf16|i8mm|fphp|fp16|vnni\w*)$"
)
# Distributions whose version can change numerics or kernels.
_PACKAGES = re.compile(
    r"^(vllm.*|torch.*|pytorch-triton.*|triton.*|transformers|tokenizers|safetensors|numpy|flashinfer.*"
    r"|flash-attn.*|xformers|nvidia-.*|cuda-python|cupy.*|intel-extension-for-pytorch|oneccl.*|openvino"
    r"|compressed-tensors|deep-gemm|deep-ep|bitsandbytes|gguf|fbgemm-gpu.*|aiter|amdsmi|xgrammar"
    r"|llguidance|mistral-common|sentencepiece|tiktoken|jinja2|huggingface-hub|ray|nixl|lmcache)$"
)
_ENV_PREFIXES = ("VLLM_", "CUBLAS_", "CUBLASLT_", "NCCL_", "TORCHINDUCTOR_")
_ENV_NAMES = {
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "TORCH_CUDNN_V8_API_DISABLED",
}
# Never numerics, and toggled for debugging (logging) or named anew by vLLM on every start (an engine in
# canaryd's own process shows them): recording them would report a stack change.
_ENV_IGNORED = re.compile(r"^VLLM_(LOGGING_\w+|CONFIGURE_LOGGING|DIST_IDENT|OBJECT_STORAGE_SHM_BUFFER_NAME)$")
# The secret-name rule (`is_secret_name`): words that mean a credential wherever they stand,
_SECRET_WORDS = {
    "SECRET",
    "SECRETS",
    "PASSWORD",
    "PASSWORDS",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "CREDENTIALS",
    "APIKEY",
    "APIKEYS",
    "KEYFILE",
}
# words that mean one unless they modify another word (an attention key, a tokenizer's token),
_SUBJECT_WORDS = {"KEY", "KEYS", "TOKEN"}
# the words that, right after a subject, make it a modifier: what is measured of keys or tokens,
_MEASURE_WORDS = {
    "BUDGET",
    "CAPACITY",
    "COUNT",
    "DIM",
    "DISTRIBUTION",
    "IDS",
    "LATENCY",
    "LEN",
    "LENGTH",
    "LIMIT",
    "LOGPROBS",
    "MAP",
    "NUM",
    "RATE",
    "RATIO",
    "SIZE",
    "THRESHOLD",
    "TYPE",
    "USAGE",
}
# and the tokenizer's words before ``token`` (``bos_token``, ``timings_per_token``, ``next_token``).
_TOKENIZER_WORDS = {"BOS", "EOS", "PAD", "UNK", "SEP", "CLS", "MASK", "PER", "FIRST", "NEXT", "DECODED"}
# Files in a model directory that decide what the model computes or how text is tokenized.
_MODEL_SUFFIXES = {
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".json",
    ".model",
    ".txt",
    ".jinja",
    ".tiktoken",
    ".py",
}
_TIMEOUT_S = 10.0


def is_secret_name(name: str) -> bool:
    """Whether a name (an environment variable, a launch argument, a key of an engine's JSON) may hold a
    credential: such a value is never recorded. The one rule of canaryd, over the name's words (split at
    ``_ . -``, spaces and camelCase):

    - ``secret``, ``password``, ``passwd``, ``passphrase``, ``credential(s)``, ``apikey``, ``keyfile``
      anywhere: ``VLLM_S3_SECRET_ACCESS``, ``OPENAI_APIKEY``, ``ssl_keyfile``;
    - ``key``, ``keys`` or ``token``, unless the word right after it says what is measured of keys or
      tokens (``key_length``, ``token_ids``, ``speculative_token_map``, ``…_TOKEN_THRESHOLD``), or
      ``token`` follows a tokenizer word (``bos_token_id``, ``timings_per_token``): ``api_key``,
      ``HF_TOKEN``, ``api_key_env``, ``token_path``, ``access_key_id``, ``OPENAI_API_KEY_2``,
      ``GITHUB_TOKEN_READONLY``, ``PRIVATE_KEY_PEM``.

    The rule fails closed: a credential name with any qualifier (where it is kept, which one, a suffix) is
    dropped, and only a known measure keeps a name. A name that says *where* a secret lives
    (``api_key_env``, ``password_file``, ``token_path``, ``secret_name``) is dropped too: it is no numerics
    fact, a path can name a user, and a misused argument may carry the secret itself; a dropped field costs
    one unwatched setting, a kept secret leaks into every store and export. Plurals of ``token`` are
    counts (``max_tokens``).
    """
    words = re.split(r"[^A-Z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).upper())
    words = [w for w in words if w]
    for i, word in enumerate(words):
        if word in _SECRET_WORDS:
            return True
        if word not in _SUBJECT_WORDS:
            continue
        measured = words[i + 1 : i + 2] and words[i + 1] in _MEASURE_WORDS
        tokenizers = word == "TOKEN" and i > 0 and words[i - 1] in _TOKENIZER_WORDS
        if not (measured or tokenizers):
            return True
    return False


def _guard(section: str, fn, *args, **kwargs) -> dict[str, str]:
    """A failing section becomes ``<section>.error``; the other sections still report."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        return {f"{section}.error": f"{e.__class__.__name__}: {str(e)[:200]}"}


def _run(cmd: list[str]) -> str | None:
    """stdout of a tool, None when it is not installed; raises when it fails."""
    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
        )
    except FileNotFoundError:
        return None
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {p.returncode}: {(p.stderr or p.stdout).strip()[:200]}")
    return p.stdout


# -- sections -------------------------------------------------------------------------------------------


def python_facts() -> dict[str, str]:
    return {
        "python.version": platform.python_version(),
        "python.implementation": platform.python_implementation(),
    }


def os_facts() -> dict[str, str]:
    out = {
        "os.system": platform.system(),
        "os.kernel": platform.release(),
        "os.machine": platform.machine(),
    }
    libc, ver = platform.libc_ver()
    if libc:
        out["os.libc"] = f"{libc} {ver}"
    try:
        text = Path("/etc/os-release").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("ID", "VERSION_ID", "PRETTY_NAME"):
            out[f"os.{key.lower()}"] = value.strip().strip('"')
    return out


def cpu_facts() -> dict[str, str]:
    out = {"cpu.count": str(os.cpu_count())}
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        out["cpu.model"] = platform.processor() or "unknown"
        return out
    first = text.split("\n\n", 1)[0]  # every core repeats the same flags
    info: dict[str, str] = {}
    for line in first.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    model = info.get("model name") or info.get("Model") or info.get("cpu model")
    if not model and "CPU implementer" in info:  # Arm: implementer/part identify the core
        model = f"arm {info['CPU implementer']}/{info.get('CPU part', '?')}"
    out["cpu.model"] = model or platform.processor() or "unknown"
    flags = (info.get("flags") or info.get("Features") or "").split()
    out["cpu.isa_flags"] = ",".join(sorted(f for f in set(flags) if _ISA.match(f)))
    return out


def nvidia_facts() -> dict[str, str]:
    fields = "name,driver_version,memory.total,compute_cap"
    base = ["nvidia-smi", "--format=csv,noheader,nounits"]
    try:
        rows = _run([*base, f"--query-gpu={fields}"])
    except RuntimeError:  # old drivers do not know compute_cap
        rows = _run([*base, "--query-gpu=name,driver_version,memory.total"])
    if rows is None:
        return {}
    out: dict[str, str] = {}
    gpus = [[c.strip() for c in line.split(",")] for line in rows.splitlines() if line.strip()]
    out["gpu.nvidia.count"] = str(len(gpus))
    for i, cols in enumerate(gpus):
        out[f"gpu.nvidia.{i}.name"] = cols[0]
        if len(cols) > 2:
            out[f"gpu.nvidia.{i}.memory_mib"] = cols[2]
        if len(cols) > 3:
            out[f"gpu.nvidia.{i}.compute_cap"] = cols[3]
    if gpus and len(gpus[0]) > 1:
        out["gpu.nvidia.driver_version"] = gpus[0][1]
    m = re.search(r"CUDA Version:\s*([\d.]+)", _run(["nvidia-smi"]) or "")
    if m:
        out["gpu.nvidia.cuda_version"] = m.group(1)
    return out


def rocm_facts() -> dict[str, str]:
    text = _run(["rocm-smi", "--showproductname", "--showdriverversion", "--json"])
    if text is None:
        return {}
    out: dict[str, str] = {}
    data = json.loads(text)
    cards = sorted(k for k in data if k.startswith("card"))
    out["gpu.rocm.count"] = str(len(cards))
    for key, value in data.items():
        if not isinstance(value, dict):
            continue
        for field, v in value.items():
            if "serial" in field.lower() or "unique" in field.lower():
                continue
            name = re.sub(r"[^A-Za-z0-9]+", "_", field.strip()).strip("_").lower()
            out[f"gpu.rocm.{key}.{name}"] = str(v)
    return out


def package_facts() -> dict[str, str]:
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        raw = dist.metadata["Name"] or ""
        name = re.sub(r"[-_.]+", "-", raw).lower()
        key = f"packages.{name}"
        if name and _PACKAGES.match(name) and key not in out:  # first on sys.path wins, as for imports
            out[key] = str(dist.version)
    return out


def torch_facts() -> dict[str, str]:
    """torch's version and build, read from ``torch/version.py`` (importing torch costs seconds)."""
    spec = util.find_spec("torch")
    if spec is None or not spec.origin:
        return {}
    tree = ast.parse(Path(spec.origin).with_name("version.py").read_text(encoding="utf-8"))
    values: dict[str, object] = {}
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and value is not None:
            try:
                values[target.id] = ast.literal_eval(value)
            except ValueError:
                continue
    names = {"__version__": "version", "cuda": "build.cuda", "hip": "build.hip", "debug": "build.debug"}
    names["git_version"] = "build.git"
    return {f"torch.{k}": "" if values.get(v) is None else str(values[v]) for v, k in names.items()}


def redact_url(value: str) -> str:
    """``value`` with the credentials of any URL in it (``user:password@``) replaced."""
    return re.sub(r"//[^/@\s]+@", "//<redacted>@", value)


def env_facts(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    return {
        f"env.{k}": redact_url(v)
        for k, v in sorted(environ.items())
        if (k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)
        and not _ENV_IGNORED.match(k)
        and not is_secret_name(k)
    }


# -- model files ----------------------------------------------------------------------------------------


def default_hash_cache() -> Path:
    """Where hashes persist: systemd's CacheDirectory=, else $XDG_CACHE_HOME/canaryd, else ~/.cache."""
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0]) / "file-hashes.json"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "canaryd" / "file-hashes.json"


_MEMO: dict[str, list] = {}  # realpath -> [dev, ino, size, mtime_ns, ctime_ns, sha256]


class HashCache:
    """sha256 of files, keyed by identity and change times (ctime cannot be set back by a user)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.entries = _MEMO
        if path is not None:
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(loaded, dict):
                    for k, v in loaded.items():
                        self.entries.setdefault(k, v)
            except (OSError, ValueError):
                pass

    def sha256(self, file: Path) -> str:
        real = os.path.realpath(file)
        st = os.stat(real)
        key = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        hit = self.entries.get(real)
        if isinstance(hit, list) and hit[:5] == key:
            return str(hit[5])
        h = hashlib.sha256()
        with open(real, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        self.entries[real] = [*key, h.hexdigest()]
        self._save()
        return h.hexdigest()

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(self.entries), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            pass  # a cache that cannot be written only costs time


def resolve_model_dir(model: str | Path, revision: str | None = None) -> tuple[Path, str | None]:
    """A local directory as is; a hub id (``org/name``) as its snapshot in the local hub cache."""
    path = Path(model).expanduser()
    if path.is_dir() or not re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)):
        return path, None
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not hub and os.environ.get("HF_HOME"):
        hub = str(Path(os.environ["HF_HOME"]) / "hub")
    if not hub:
        hub = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub")
    repo = Path(hub) / f"models--{str(model).replace('/', '--')}"
    ref = revision or "main"
    sha = ref
    if (repo / "refs" / ref).is_file():
        sha = (repo / "refs" / ref).read_text(encoding="utf-8").strip()
    return repo / "snapshots" / sha, sha


def model_files(model_dir: Path) -> list[Path]:
    files = []
    for p in sorted(model_dir.rglob("*")):
        rel = p.relative_to(model_dir)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if p.suffix.lower() in _MODEL_SUFFIXES or p.name == "tokenizer.model":
            files.append(p)
    return files


def chat_template(model_dir: Path) -> str | None:
    """The template transformers would use: chat_template.jinja, else tokenizer_config's or .json's."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.json"):
        f = model_dir / name
        if f.is_file():
            tpl = json.loads(f.read_text(encoding="utf-8")).get("chat_template")
            if tpl is not None:
                return tpl if isinstance(tpl, str) else json.dumps(tpl, sort_keys=True)
    return None


def model_facts(
    model: str | Path, revision: str | None = None, cache: HashCache | None = None
) -> dict[str, str]:
    model_dir, rev = resolve_model_dir(model, revision)
    if not model_dir.is_dir():
        return {"model.error": f"not a directory: {model_dir}"}
    cache = cache or HashCache()
    out = {
        f"model.files.{f.relative_to(model_dir).as_posix()}": cache.sha256(f) for f in model_files(model_dir)
    }
    if rev is not None:
        out["model.revision"] = rev
    tpl = chat_template(model_dir)
    if tpl is not None:
        out["model.chat_template_sha256"] = hashlib.sha256(tpl.encode()).hexdigest()
    return out


# -- everything -----------------------------------------------------------------------------------------


def collect(
    model_dir: str | Path | None = None,
    *,
    revision: str | None = None,
    process: bool = True,
    hash_cache: Path | None = None,
) -> dict[str, str]:
    """All sections; ``process=False`` leaves out this process's own facts (its environment)."""
    out: dict[str, str] = {}
    out.update(_guard("python", python_facts))
    out.update(_guard("os", os_facts))
    out.update(_guard("cpu", cpu_facts))
    out.update(_guard("gpu.nvidia", nvidia_facts))
    out.update(_guard("gpu.rocm", rocm_facts))
    out.update(_guard("packages", package_facts))
    out.update(_guard("torch", torch_facts))
    if process:
        out.update(_guard("env", env_facts))
    if model_dir is not None:
        out.update(_guard("model", model_facts, model_dir, revision, HashCache(hash_cache)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print facts about this host and Python environment as JSON.")
    ap.add_argument("--model-dir", help="model directory (or hub id in the local cache) to hash")
    ap.add_argument("--revision", help="hub revision, with a hub id")
    ap.add_argument("--hash-cache", type=Path, help="JSON file that keeps file hashes between runs")
    ap.add_argument("--no-process-facts", action="store_true", help="leave out this process's environment")
    args = ap.parse_args(argv)
    facts = collect(
        args.model_dir, revision=args.revision, process=not args.no_process_facts, hash_cache=args.hash_cache
    )
    json.dump(facts, sys.stdout, sort_keys=True, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
