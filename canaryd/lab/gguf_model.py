"""Write a `tinymodel` (Hugging Face safetensors + byte-level tokenizer) as a GGUF file for llama.cpp.

The llama.cpp e2e tests serve the *same* weights vLLM serves, so both answer the same canaries, and
re-quantise them (F32 → Q8_0, or F16) to show what a silent quantisation change looks like. Written with
the ``gguf`` package from the model directory alone (numpy, no torch):

- the tokenizer becomes a GPT-2-style BPE vocabulary (``tokenizer.ggml.model = "gpt2"``): token id ==
  byte value for the 256 byte symbols, then the special tokens (control), then whole-word tokens (user
  defined, matched before byte splitting as the HF tokenizer does). The HF tokenizer has no merges;
  llama.cpp insists on the merges key and gguf cannot write an empty array, so it gets one merge of two
  special tokens, which can never apply (BPE starts from single characters and only grows by merges).
- the weights get llama.cpp's tensor names; Q and K rows are reordered per head from Hugging Face's
  rotate-half RoPE layout to the interleaved pairs llama.cpp's ``llama`` architecture rotates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FILE_TYPES = ("F32", "F16", "Q8_0")
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face Llama tensor (``model.layers.0.mlp.up_proj.weight`` →
    ``blk.0.ffn_up.weight``)."""
    base, _, suffix = hf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES['.'.join(parts[3:])]}.{suffix}"
    raise ValueError(f"tensor {hf_name!r} has no GGUF name (not a Llama model?)")


def interleave_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a Q or K projection, per head, from halves ``[x0..x(d/2-1), y0..]`` (HF rotate-half) to
    pairs ``[x0, y0, x1, y1, ...]`` (llama.cpp's normal RoPE), so that both rotate the same pairs."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _vocab(model_dir: Path, size: int) -> tuple[list[str], list[int], dict]:
    """Token strings and types (by id) from tokenizer.json, and the special tokens' ids."""
    from gguf import TokenType

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = [""] * size
    types = [int(TokenType.UNUSED)] * size
    for sym, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = sym, int(TokenType.NORMAL)
    specials = {}
    for added in tok["added_tokens"]:
        i = added["id"]
        tokens[i] = added["content"]
        types[i] = int(TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED)
        if added["special"]:
            specials[added["content"]] = i
    missing = [i for i, t in enumerate(tokens) if not t]
    if missing:
        raise ValueError(f"{model_dir}/tokenizer.json: no token for ids {missing[:5]}")
    return tokens, types, specials


def write_gguf(
    model_dir: Path, out: Path, *, file_type: str = "F32", chat_template: str | None = None
) -> Path:
    """Write ``model_dir`` (a `tinymodel` build) to ``out`` as GGUF in ``file_type`` (F32, F16 or Q8_0:
    every 2-D weight in that type, norms in F32, as llama.cpp's own converter does); ``chat_template``
    replaces the tokenizer config's. Written to a temporary name first: a half-written file never stays."""
    import gguf
    from safetensors.numpy import load_file

    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {', '.join(FILE_TYPES)}, not {file_type!r}")
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokens, types, specials = _vocab(model_dir, cfg["vocab_size"])
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(model_dir.name)
    w.add_file_type(
        {
            "F32": gguf.LlamaFileType.ALL_F32,
            "F16": gguf.LlamaFileType.MOSTLY_F16,
            "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        }[file_type]
    )
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["<s> </s>"])  # inert: see the module docstring
    w.add_bos_token_id(specials[tok_cfg["bos_token"]])
    w.add_eos_token_id(specials[tok_cfg["eos_token"]])
    w.add_pad_token_id(specials[tok_cfg["pad_token"]])
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    w.add_add_eos_token(bool(tok_cfg.get("add_eos_token", False)))
    w.add_chat_template(chat_template if chat_template is not None else tok_cfg["chat_template"])

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    for hf_name in sorted(tensors):
        name, x = gguf_name(hf_name), tensors[hf_name].astype(np.float32)
        if name.endswith("attn_q.weight"):
            x = interleave_rope(x, n_head)
        elif name.endswith("attn_k.weight"):
            x = interleave_rope(x, n_kv)
        if x.ndim == 1 or file_type == "F32":
            w.add_tensor(name, np.ascontiguousarray(x))
        elif file_type == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out
