"""GGUF file -> Hugging Face-style folder (float32 safetensors + tokenizer.json + configs).

A GGUF (llama.cpp's format) is one file holding everything: metadata (shapes, RoPE base, the
vocabulary, merges, chat template) and quantized tensors. The rest of minillm reads the Hugging Face
layout, so this module translates once, at download time:

    GGUF metadata  -> config.json, generation_config.json, tokenizer_config.json
    GGUF tokens    -> tokenizer.json (built with the `tokenizers` library)
    GGUF tensors   -> model.safetensors (dequantized to float32 by `gguf.quants.dequantize`)

Byte order: a GGUF says its byte order by how its version number reads (llama.cpp's converter
writes big-endian files with ``--bigendian``, for s390x). Every tensor is read through
:func:`read_tensor`, which turns the file's numbers into this machine's order; packed block data
(Q4_K, Q8_0, ..., BF16 as bytes) has no byte order gguf can state, so a big-endian file holding it is
refused rather than read as garbage.

Three translations are not just renames, and each has a comment where it happens:
- GGUF lists a tensor's dims fastest-first (`[in, out]`); NumPy wants `[out, in]`.
- llama.cpp reorders q_proj/k_proj rows for its interleaved RoPE (llama family); we undo that for
  HF's half-split.
- llama.cpp's Gemma converter stores RMSNorm weights as `1 + w` (what Gemma multiplies by); HF
  stores `w`, so we subtract the 1 (transformers' own GGUF loader does the same).

Family differences live in the `ARCHITECTURES` table of `gguf_families.py` (metadata keys, tensor
names, settings the GGUF leaves out); the file is read in `gguf_reader.py`; the tokenizer (byte-level
or SentencePiece BPE) is rebuilt in `gguf_tokenizer.py`.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections import Counter
from typing import Any

import numpy as np

from minillm.errors import GGUFError
from minillm.sources.gguf_families import _REQUIRED, ARCHITECTURES, ArchSpec, plan_tensors, unpermute_rope_rows
from minillm.sources.gguf_packed import PackedTensor, read_packed_tensors  # noqa: F401 (re-exported)
from minillm.sources.gguf_reader import (  # noqa: F401 (GGUF_MAGIC, is_big_endian re-exported)
    GGUF_MAGIC,
    check_tensor_types,
    is_big_endian,
    read_gguf,
    read_tensor,
)
from minillm.sources.gguf_tokenizer import build_tokenizer
from minillm.sources.wheels import file_sha256


# --- public API ---------------------------------------------------------------------------------
def import_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    source: dict | None = None,
) -> pathlib.Path:
    """Convert a GGUF file into a Hugging Face-style folder at out_dir (created; must not exist or be empty).

    Writes into ``out_dir``:

    - ``config.json``: HF field names for the architecture (llama -> ``LlamaForCausalLM``, gemma3 ->
      ``Gemma3ForCausalLM`` with the settings llama.cpp hard-codes: layer_types, local RoPE base,
      query_pre_attn_scalar); ``tie_word_embeddings`` is true when the GGUF has no ``output.weight``.
    - ``model.safetensors``: every tensor dequantized to float32 under its HF name, shaped
      ``[out_features, in_features]`` (e.g. q_proj ``[n_heads * head_dim, d_model]``, embeddings
      ``[vocab, d_model]``, norms ``[d_model]``); q/k rows put back in HF's half-split RoPE order
      (llama), Gemma's norms back to ``w`` from llama.cpp's ``1 + w``.
    - ``tokenizer.json`` (byte-level BPE from the GGUF vocabulary and merges, or SentencePiece-style
      BPE with merges rebuilt from the scores: see ``gguf_tokenizer.py``), ``tokenizer_config.json``
      (special tokens, chat template if the GGUF has one), ``generation_config.json`` (bos/eos ids).
    - ``minillm_source.json``: file name, sha256, size, quantization summary, plus the ``source``
      dict's keys (e.g. where the file came from); the measured values win over same-named keys.

    Returns ``out_dir`` as a Path. Raises :class:`~minillm.errors.GGUFError` when the file is
    missing, is not a GGUF, is truncated or unreadable, has an unsupported architecture, tokenizer
    or tensor type, or when ``out_dir`` already holds files.
    """
    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    reader, meta, arch_name = _read_supported(gguf_path)
    spec = ARCHITECTURES[arch_name]
    check_tensor_types(gguf_path, reader)
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    config = _build_config(gguf_path, spec, arch_name, meta, reader, n_tokens=len(tokens))
    plan = plan_tensors(gguf_path, spec, reader, config)
    tokenizer, pre_used = build_tokenizer(gguf_path, meta)

    if out_dir.exists() and any(out_dir.iterdir()):
        raise GGUFError(f"output folder {out_dir} is not empty; remove it or choose another folder")
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors = convert_tensors(gguf_path, spec, reader, plan, config, progress)
    from safetensors.numpy import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta, tokens, config))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out_dir / "generation_config.json", generation)
    facts = {
        "gguf_file": gguf_path.name,
        "gguf_sha256": file_sha256(gguf_path),
        "gguf_size": gguf_path.stat().st_size,
        "architecture": arch_name,
        "quantization": quantization_summary(reader),
        "dequantized_to": "float32",
        "tokenizer": pre_used,
    }
    _write_json(out_dir / "minillm_source.json", {**(source or {}), **facts})  # measured facts win
    return out_dir


def _read_supported(gguf_path: pathlib.Path):
    """(reader, metadata, architecture name) of a GGUF whose architecture minillm imports.

    Raises:
        GGUFError: the file is unreadable, or its architecture is not in ``ARCHITECTURES``.
    """
    reader, meta = read_gguf(gguf_path)
    arch_name = meta.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf_path.name}: architecture {arch_name!r} is not supported (supported: "
            f"{sorted(ARCHITECTURES)}); pick a GGUF of a supported family, or add an entry to "
            "minillm.sources.gguf_families.ARCHITECTURES"
        )
    return reader, meta, arch_name


def import_gguf_header(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """The files :func:`import_gguf` writes from a GGUF's header, without its weights.

    Writes ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
    ``generation_config.json`` into ``out_dir`` (created; must not exist or be empty), the same
    bytes :func:`import_gguf` writes for them; no tensor is read or dequantized. What a memory plan
    needs of a model whose config lives only inside its GGUF (``sources/plan_files.py``).

    Returns ``out_dir`` as a Path. Raises :class:`~minillm.errors.GGUFError` as :func:`import_gguf`.
    """
    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    reader, meta, arch_name = _read_supported(gguf_path)
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    config = _build_config(gguf_path, ARCHITECTURES[arch_name], arch_name, meta, reader, n_tokens=len(tokens))
    tokenizer, _ = build_tokenizer(gguf_path, meta)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise GGUFError(f"output folder {out_dir} is not empty; remove it or choose another folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta, tokens, config))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out_dir / "generation_config.json", generation)
    return out_dir


def quantization_summary(reader) -> str:
    """Say which tensor types a GGUF holds, e.g. ``"Q4_1 (token_embd Q8_0)"``.

    The main type is the most common among the big (non-F32) tensors; others follow in brackets,
    by tensor name when only one tensor has that type, else as a count.
    """
    quantized = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type.name != "F32"]
    if not quantized:
        return "F32"
    counts = Counter(kind for _, kind in quantized)
    main = counts.most_common(1)[0][0]
    others = []
    for kind, n in sorted(counts.items()):
        if kind == main:
            continue
        names = [name.removesuffix(".weight") for name, k in quantized if k == kind]
        others.append(f"{names[0]} {kind}" if n == 1 else f"{kind} x{n}")
    return main + (f" ({', '.join(others)})" if others else "")


# --- config -------------------------------------------------------------------------------------
def _build_config(path, spec: ArchSpec, arch: str, meta: dict, reader, n_tokens: int) -> dict:
    """HF config.json fields from the `{arch}.*` metadata, following spec.config_keys."""
    cfg: dict[str, Any] = {"architectures": [spec.hf_class], "model_type": spec.model_type}
    for hf_name, (key, default) in spec.config_keys.items():
        value = meta.get(f"{arch}.{key}", default)
        if value is _REQUIRED:
            raise GGUFError(f"{path.name}: metadata key {arch}.{key} is missing (needed for {hf_name})")
        if isinstance(value, list):
            raise GGUFError(f"{path.name}: {arch}.{key} varies per layer ({value[:4]}...); not supported")
        cfg[hf_name] = value
    if cfg.get("num_key_value_heads") is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("vocab_size") is None:
        cfg["vocab_size"] = n_tokens
    rope_dims = meta.get(f"{arch}.rope.dimension_count", cfg["head_dim"])
    if rope_dims != cfg["head_dim"]:
        raise GGUFError(f"{path.name}: RoPE on {rope_dims} of {cfg['head_dim']} head dims is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" and scaling not in spec.rope_scaling:
        raise GGUFError(f"{path.name}: RoPE scaling {scaling!r} is not supported yet; use a model without it")
    if scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
    cfg.update(spec.fixed_config)
    if spec.derive is not None:
        spec.derive(cfg, meta)
    cfg["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    cfg["bos_token_id"] = meta.get("tokenizer.ggml.bos_token_id")
    cfg["eos_token_id"] = meta.get("tokenizer.ggml.eos_token_id")
    if (pad := meta.get("tokenizer.ggml.padding_token_id")) is not None:
        cfg["pad_token_id"] = pad
    cfg["torch_dtype"] = "float32"
    return cfg


def convert_tensors(path, spec: ArchSpec, reader, plan, config: dict, progress: bool) -> dict[str, np.ndarray]:
    """Dequantize every planned tensor to float32 under its HF name, in HF's `[out, in]` layout."""
    from rich.progress import track

    out: dict[str, np.ndarray] = {}
    for t, hf_name, local in track(plan, f"dequantizing {path.name}", transient=True, disable=not progress):
        # GGUF lists dims fastest-varying first ([in, out]); NumPy/HF order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        w = read_tensor(reader, t, path).reshape(shape)  # a float32 copy, in this machine's byte order
        if local in spec.rope_permuted:
            w = unpermute_rope_rows(w, config[spec.rope_permuted[local]])
        if spec.norm_shift and t.name.endswith("norm.weight"):
            w -= np.float32(spec.norm_shift)  # llama.cpp stored 1 + w (Gemma's multiplier); HF wants w
        out[hf_name] = w
    return out


# --- tokenizer_config.json ------------------------------------------------------------------------
def _tokenizer_config(meta: dict, tokens: list[str], config: dict) -> dict:
    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        i = i[0] if isinstance(i, list) and i else i
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }


# --- small helpers ------------------------------------------------------------------------------
def _write_json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
