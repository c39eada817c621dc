"""Build a tiny Llama-style model in Hugging Face format, fully offline.

canaryd's tests and ``canaryd demo`` need a *real* model that a real vLLM
server can load, on a CPU-only machine with no hub access.  So we make one:
a byte-level tokenizer (no vocabulary download, any text round-trips), a
two-layer Llama with random weights, and optionally a few hundred AdamW steps
so that it answers a handful of known-answer canary prompts correctly under
greedy decoding.  ``perturb_weights`` then produces the "silently degraded"
variants (int8 round trip, gaussian noise) that canaries exist to catch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from canaryd import progress

MARKER = "canaryd-tinymodel.json"
PERTURBED = "canaryd-perturbed.json"  # what a perturbed copy was made from, so that a repeat call is free
# Bump when the build recipe changes so old cached directories are rebuilt.
RECIPE_VERSION = 1
SPECIAL_TOKENS = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
# Each turn is "<|role|>content\n"; the generation prompt is "<|assistant|>".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# vLLM's CPU attention backend only supports head sizes such as 64/128, so
# the model is 2 heads x 64 rather than something even smaller.
CONFIG = {
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 257,
}
# Training stops only once every answer wins greedily by this many logits,
# so small numeric differences (vLLM kernels vs. HF eager) do not flip it.
MARGIN = 2.0

# (chat messages, answer) pairs; a plain string instead of messages is a raw completion prompt.
Train = Sequence[tuple[list[dict[str, str]] | str, str]]


def _config(words: Sequence[str]) -> dict:
    return {**CONFIG, "vocab_size": CONFIG["vocab_size"] + len(words)}


def _tokenizer(words: Sequence[str] = ()):
    """A byte-level BPE without merges: 256 byte symbols, the specials, then ``words`` as whole tokens.

    Whole-word tokens let the demo model give one-token answers ("Yes") that bytes alone cannot.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Token id == byte value, which keeps ids readable in samples and tests.
    vocab = {sym: b for b, sym in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


def _save_tokenizer(tok, out_dir: Path) -> None:
    """Write tokenizer.json and a tokenizer_config.json carrying the template.

    Written by hand (not ``save_pretrained``) so the files are stable across
    transformers releases and the chat template sits where vLLM looks first.
    """
    tok.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _examples(tok, train: Train) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + eos) for each pair, as vLLM would see them."""
    out = []
    for messages, answer in train:
        prompt = (
            messages
            if isinstance(messages, str)
            else tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )
        p = tok.encode(prompt, add_special_tokens=False)
        a = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_id]
        out.append((p, a))
    return out


def _train(model, examples, steps: int, lr: float = 3e-3) -> tuple[int, bool]:
    """AdamW on the answer tokens until all answers win greedily by MARGIN.

    A teacher-forced argmax check is exact for greedy decoding: generation
    reproduces answer+eos iff every answer position's argmax is the target.
    """
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), CONFIG["pad_token_id"])
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (p, a) in enumerate(examples):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p) : n] = torch.tensor(a)
        mask[i, :n] = 1
    # Next-token targets: position t predicts labels[t + 1].
    tgt = labels[:, 1:]
    sel = tgt != -100
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    progress.begin(steps, "the tiny model")  # at most `steps`: it stops once every answer wins
    for step in range(1, steps + 1):
        progress.step()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        if step % 10 == 0 or step == steps:
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1][sel]
            t = tgt[sel]
            right = logits.gather(1, t[:, None])[:, 0]
            others = logits.scatter(1, t[:, None], float("-inf")).max(1).values
            if bool(((right - others) > MARGIN).all()):
                model.eval()
                return step, True
    model.eval()
    return steps, False


def _digest(seed: int, train: Train, steps: int, words: Sequence[str]) -> str:
    blob = json.dumps(
        {
            "v": RECIPE_VERSION,
            "seed": seed,
            "train": [[m, a] for m, a in train],
            "steps": steps,
            "config": _config(words),
            "words": list(words),
            "template": CHAT_TEMPLATE,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def build_tiny_model(
    out_dir: Path, *, seed: int = 0, train: Train = (), steps: int = 300, words: Sequence[str] = ()
) -> Path:
    """Build (or reuse) the tiny model in ``out_dir`` and return the path.

    ``train`` holds (chat messages, expected answer) pairs the model should
    learn to answer greedily; training stops early once it does, or after
    ``steps``.  A marker file with a hash of every input makes repeat calls
    free, which matters because tests build the model in many places.
    """
    out_dir = Path(out_dir)
    marker = out_dir / MARKER
    digest = _digest(seed, train, steps, words)
    if _made(marker, digest):
        return out_dir
    with _exclusive(out_dir):
        if not _made(marker, digest):  # another process may have built it while this one waited
            _build(out_dir, marker, digest, seed, train, steps, words)
    return out_dir


def _made(marker: Path, digest: str) -> bool:
    return marker.exists() and json.loads(marker.read_text()).get("digest") == digest


@contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """One builder per model directory across processes (test workers share the model cache)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(out_dir: Path, marker: Path, digest: str, seed: int, train: Train, steps: int, words) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # a half-finished rebuild must not look cached
    tok = _tokenizer(words)
    torch.manual_seed(seed)
    config = LlamaConfig(**_config(words))
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).float()
    used, ok = (0, True)
    if train:
        used, ok = _train(model, _examples(tok, train), steps)
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_tokenizer(tok, out_dir)
    info = {"digest": digest, "seed": seed, "train_pairs": len(train), "steps_used": used, "learned": ok}
    marker.write_text(json.dumps(info, indent=2))


MODES = ("int8", "int4", "noise", "prune")


def perturb_weights(src: Path, dst: Path, *, mode: str, scale: float = 0.05, seed: int = 0) -> Path:
    """Copy a model directory to ``dst`` with degraded weights.

    ``int8``: symmetric per-row int8 quantise/dequantise of every 2-D weight,
    like a careless quantised deployment.  ``int4``: symmetric 4-bit round trip
    in groups of 32 weights along each row (levels -7..7, one scale per group),
    the shape of the GPTQ/AWQ-style 4-bit builds providers serve.  ``noise``: add seeded gaussian noise
    with std ``scale`` times each 2-D tensor's own std.  ``prune``: magnitude pruning, the ``scale``
    fraction of each 2-D tensor's smallest-magnitude weights set to 0.  Tokenizer and config
    are copied unchanged; the build marker is not, so ``dst`` is never
    mistaken for a cached clean build.  A marker of its own (the source's
    weight files and the recipe) makes a repeat call free, and one process
    at a time writes ``dst``, so parallel test workers never read a half copy.
    """
    if mode not in MODES:
        raise ValueError(f"unknown perturbation mode {mode!r} (expected one of {', '.join(MODES)})")
    src, dst = Path(src), Path(dst)
    weights = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(src.glob("*.safetensors"))]
    recipe = json.dumps({"src": weights, "mode": mode, "scale": scale, "seed": seed})
    digest = hashlib.sha256(recipe.encode()).hexdigest()
    with _exclusive(dst):
        if not _made(dst / PERTURBED, digest):
            _perturb(src, dst, mode, scale, seed)
            (dst / PERTURBED).write_text(json.dumps({"digest": digest}))
    return dst


def _round_trip_int4(x, group: int = 32):
    """Quantise ``x`` (2-D) to 4 bits in groups of ``group`` along each row and back."""
    import torch

    rows, cols = x.shape
    g = torch.nn.functional.pad(x, (0, (-cols) % group)).reshape(rows, -1, group)
    step = g.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 7
    return ((g / step).round().clamp(-7, 7) * step).reshape(rows, -1)[:, :cols]


def _perturb(src: Path, dst: Path, mode: str, scale: float, seed: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    (dst / PERTURBED).unlink(missing_ok=True)  # a half-finished copy must not look made
    for f in src.iterdir():
        if f.is_file() and f.name not in (MARKER, PERTURBED) and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(f)
        for name, w in sorted(tensors.items()):
            if w.ndim != 2:
                continue
            x = w.float()
            if mode == "int8":
                step = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
                x = (x / step).round().clamp(-127, 127) * step
            elif mode == "int4":
                x = _round_trip_int4(x)
            elif mode == "prune":
                cut = int(scale * x.numel())
                if cut:
                    x = x.flatten().clone()
                    x[x.abs().argsort()[:cut]] = 0.0
                    x = x.reshape(w.shape)
            else:
                x = x + torch.randn(x.shape, generator=gen) * (scale * x.std())
            tensors[name] = x.to(w.dtype).contiguous()
        save_file(tensors, dst / f.name, metadata={"format": "pt"})


def finetune_step(src: Path, dst: Path, *, train: Train, lr: float) -> Path:
    """Copy a model directory to ``dst`` after one AdamW step at ``lr`` on the batch ``train``: a
    provider's fine-tuning step, the third axis of Log Probability Tracking's variants. Adam's first step
    moves every weight by at most ``lr``. Cached and locked as `perturb_weights` is."""
    src, dst = Path(src), Path(dst)
    weights = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(src.glob("*.safetensors"))]
    recipe = json.dumps({"src": weights, "mode": "finetune", "lr": lr, "train": list(train)})
    digest = hashlib.sha256(recipe.encode()).hexdigest()
    with _exclusive(dst):
        if not _made(dst / PERTURBED, digest):
            _finetune(src, dst, train, lr)
            (dst / PERTURBED).write_text(json.dumps({"digest": digest}))
    return dst


def _finetune(src: Path, dst: Path, train: Train, lr: float) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    (dst / PERTURBED).unlink(missing_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in (MARKER, PERTURBED) and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    _train(model, _examples(AutoTokenizer.from_pretrained(src), train), steps=1, lr=lr)
    model.save_pretrained(dst, safe_serialization=True)
