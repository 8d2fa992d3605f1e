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

Family differences live in the `ARCHITECTURES` table (metadata keys, tensor names, settings the
GGUF leaves out); the tokenizer (byte-level or SentencePiece BPE) is rebuilt in `gguf_tokenizer.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minillm.errors import GGUFError
from minillm.sources.gguf_tokenizer import build_tokenizer

GGUF_MAGIC = b"GGUF"
_REQUIRED = object()  # marks a metadata key that has no sensible default


# --- per-architecture tables -------------------------------------------------------------------
@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF `general.architecture` maps onto a Hugging Face config and tensor names."""

    model_type: str  # HF config.json "model_type"
    hf_class: str  # HF config.json "architectures"[0]
    # HF config field -> (GGUF key below "{arch}.", default or _REQUIRED; None = derived later)
    config_keys: dict[str, tuple[str, Any]]
    fixed_config: dict[str, Any]
    global_tensors: dict[str, str]  # GGUF name -> HF name
    block_tensors: dict[str, str]  # GGUF name after "blk.{i}." -> HF name after "model.layers.{i}."
    # block tensors whose rows llama.cpp permuted for RoPE -> HF config field with their head count
    rope_permuted: dict[str, str] = field(default_factory=dict)
    # RMSNorm weights ("*norm.weight") are stored as w + norm_shift (Gemma: 1.0)
    norm_shift: float = 0.0
    # RoPE scaling types (`{arch}.rope.scaling.type`) this family's config can say
    rope_scaling: tuple[str, ...] = ()
    # fills config fields the GGUF metadata leaves out: (cfg, meta) -> None
    derive: Callable[[dict, dict], None] | None = None


LLAMA = ArchSpec(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    config_keys={
        "hidden_size": ("embedding_length", _REQUIRED),
        "intermediate_size": ("feed_forward_length", _REQUIRED),
        "num_hidden_layers": ("block_count", _REQUIRED),
        "num_attention_heads": ("attention.head_count", _REQUIRED),
        "num_key_value_heads": ("attention.head_count_kv", None),  # absent: same as head_count
        "head_dim": ("attention.key_length", None),  # absent: hidden_size // head_count
        "max_position_embeddings": ("context_length", _REQUIRED),
        "rms_norm_eps": ("attention.layer_norm_rms_epsilon", _REQUIRED),
        "rope_theta": ("rope.freq_base", 10000.0),
        "vocab_size": ("vocab_size", None),  # absent: number of tokens
    },
    fixed_config={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    global_tensors={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",  # absent when the LM head is tied to the embedding
    },
    block_tensors={
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
    rope_permuted={"attn_q.weight": "num_attention_heads", "attn_k.weight": "num_key_value_heads"},
)


def _gemma3_defaults(cfg: dict, meta: dict) -> None:
    """What llama.cpp's Gemma 3 code hard-codes rather than stores (llama-model.cpp, LLM_ARCH_GEMMA3),
    in Gemma3TextConfig's field names."""
    n_layers = cfg["num_hidden_layers"]
    # 5 sliding-window layers, then 1 global, repeated (llama.cpp: set_swa_pattern(6))
    cfg["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    cfg["rope_local_base_freq"] = 10000.0  # sliding layers' RoPE base (freq_base_train_swa)
    # Scores are scaled by head_dim ** -0.5, except in the 27B (62 layers): (d_model / heads) ** -0.5.
    per_head = cfg["hidden_size"] // cfg["num_attention_heads"] if n_layers == 62 else cfg["head_dim"]
    cfg["query_pre_attn_scalar"] = per_head
    cfg["final_logit_softcapping"] = meta.get("gemma3.final_logit_softcapping")


GEMMA3 = ArchSpec(
    model_type="gemma3_text",
    hf_class="Gemma3ForCausalLM",
    config_keys={
        **LLAMA.config_keys,
        "head_dim": ("attention.key_length", _REQUIRED),
        "rope_theta": ("rope.freq_base", 1_000_000.0),
        "sliding_window": ("attention.sliding_window", _REQUIRED),
    },
    fixed_config={"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False},
    global_tensors={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    block_tensors={
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    # no rope_permuted: llama.cpp runs Gemma with the half-split ("NEOX") RoPE, rows as in HF
    norm_shift=1.0,
    rope_scaling=("linear",),  # Gemma 3 4B and up: linear scaling on the global layers
    derive=_gemma3_defaults,
)

#: general.architecture -> its table.
ARCHITECTURES: dict[str, ArchSpec] = {"llama": LLAMA, "gemma3": GEMMA3}


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
    reader, meta = _read_gguf(gguf_path)
    arch_name = meta.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf_path.name}: architecture {arch_name!r} is not supported (supported: "
            f"{sorted(ARCHITECTURES)}); pick a GGUF of a supported family, or add an entry to "
            "minillm.gguf_import.ARCHITECTURES"
        )
    spec = ARCHITECTURES[arch_name]
    _check_tensor_types(gguf_path, reader)
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    config = _build_config(gguf_path, spec, arch_name, meta, reader, n_tokens=len(tokens))
    plan = _plan_tensors(gguf_path, spec, reader, config)
    tokenizer, pre_used = build_tokenizer(gguf_path, meta)

    if out_dir.exists() and any(out_dir.iterdir()):
        raise GGUFError(f"output folder {out_dir} is not empty; remove it or choose another folder")
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors = _convert_tensors(gguf_path, spec, reader, plan, config, progress)
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
        "gguf_sha256": _sha256(gguf_path),
        "gguf_size": gguf_path.stat().st_size,
        "architecture": arch_name,
        "quantization": quantization_summary(reader),
        "dequantized_to": "float32",
        "tokenizer": pre_used,
    }
    _write_json(out_dir / "minillm_source.json", {**(source or {}), **facts})  # measured facts win
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


# --- reading ------------------------------------------------------------------------------------
def _read_gguf(path: pathlib.Path) -> tuple[Any, dict[str, Any]]:
    """(GGUFReader, metadata dict) after checking the file exists and starts with b"GGUF".

    Every failure is a GGUFError: missing file, wrong magic, truncated or corrupt contents.
    """
    reader = _open_gguf(path)
    try:
        return reader, {name: _field_value(f) for name, f in reader.fields.items()}
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError) as exc:
        raise _unreadable(path, exc) from exc


def _open_gguf(path: pathlib.Path):
    """A ``gguf.GGUFReader`` on ``path``, after checking it exists and starts with b"GGUF"."""
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}; check the path, or fetch the model again")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}; "
            "pass a .gguf file (a partial download or an HTML error page looks like this)"
        )
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError) as exc:
        raise _unreadable(path, exc) from exc


def _unreadable(path: pathlib.Path, exc: Exception) -> GGUFError:
    import gguf

    # The reader memory-maps the file and slices it by the sizes in its header, so a short file
    # shows up as a NumPy reshape/view error; say what it means instead.
    return GGUFError(
        f"cannot read GGUF {path} ({path.stat().st_size:,} bytes): {exc}. The file is probably "
        "truncated or corrupt (download it again and check its sha256), or uses a GGUF feature "
        f"newer than gguf {getattr(gguf, '__version__', '')} knows (pip install -U gguf)"
    )


def _field_value(field_) -> Any:
    value = field_.contents()
    if isinstance(value, float):
        # GGUF stores floats as float32; keep the shortest float32 decimal (1e-05, not 9.9999997e-06)
        return float(str(np.float32(value)))
    return value


# Tensor types stored as plain numbers: read with the file's byte order, then widened to float32.
_NUMBER_TYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


def is_big_endian(reader) -> bool:
    """True if the GGUF was written big-endian (gguf's reader tells from the version field)."""
    import gguf

    return reader.endianess == gguf.GGUFEndian.BIG


def read_tensor(reader, t, path: pathlib.Path | None = None) -> np.ndarray:
    """One GGUF tensor as float32 in this machine's byte order, shaped as the file stores it
    (gguf's reader shape; :func:`_convert_tensors` reshapes to HF's ``[out, in]``).

    Plain number types (F32, F16, F64, I8..I64) are read in the file's byte order, whatever it
    is; block-quantized types and BF16 are dequantized with ``gguf.quants`` from a little-endian
    file. Raises GGUFError for packed data in a big-endian file (never read silently wrong).
    """
    kind = t.tensor_type.name
    if kind in _NUMBER_TYPES:
        # gguf's reader views these with the file's byte order (e.g. '>f4'); astype converts the
        # *values* to native float32. (gguf.quants.dequantize would reinterpret the bytes instead.)
        native = np.dtype(_NUMBER_TYPES[kind]).newbyteorder("=")
        return np.asarray(t.data).astype(native).astype(np.float32)
    if is_big_endian(reader):
        name = path.name if path is not None else "the GGUF"
        raise GGUFError(
            f"{name} is big-endian and tensor {t.name} is {kind}: packed block data (its fp16 scales) has no "
            "byte order gguf can state, so it cannot be read safely; convert the model little-endian "
            "(llama.cpp's convert_hf_to_gguf.py without --bigendian), or big-endian as F32/F16"
        )
    return dequantize_rows(t.data, t.tensor_type)


def dequantize_rows(data: np.ndarray, qtype, rows_per_chunk: int = 4096) -> np.ndarray:
    """``gguf.quants.dequantize(data, qtype)`` as float32, a few thousand rows at a time.

    ``data`` is the packed uint8 ``[rows, row_bytes]`` (or 1-D) of a block-quantized tensor; the
    result is float32 ``[rows, row_values]``, the same bits as one call (blocks are independent).
    Why in chunks: one call over a large matrix holds several float32 temporaries of the whole
    matrix at once (Gemma 3's 262,144-row embedding), which set the conversion's peak memory.
    """
    import gguf

    data = np.asarray(data)
    if data.ndim < 2 or data.shape[0] <= rows_per_chunk:
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    first = np.asarray(gguf.quants.dequantize(data[:rows_per_chunk], qtype), dtype=np.float32)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:rows_per_chunk] = first
    for start in range(rows_per_chunk, data.shape[0], rows_per_chunk):
        out[start : start + rows_per_chunk] = gguf.quants.dequantize(data[start : start + rows_per_chunk], qtype)
    return out


def _check_tensor_types(path: pathlib.Path, reader) -> None:
    """Fail before any work if a tensor type cannot be read: gguf.quants has no dequantizer for it,
    or it is packed data in a big-endian file (see :func:`read_tensor`)."""
    import gguf

    for qtype in sorted({t.tensor_type for t in reader.tensors}):
        if qtype.name in _NUMBER_TYPES:
            continue
        if is_big_endian(reader):
            read_tensor(reader, next(t for t in reader.tensors if t.tensor_type == qtype), path)  # raises
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:  # one all-zero block is enough to learn whether a dequantizer exists
            gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except NotImplementedError:
            names = [t.name for t in reader.tensors if t.tensor_type == qtype]
            raise GGUFError(
                f"{path.name}: tensor {names[0]} ({len(names)} tensor(s)) has type {qtype.name}, "
                "which gguf.quants cannot dequantize; use a GGUF quantized as F32/F16/BF16/Q4_K/Q8_0 "
                "or similar, or upgrade the gguf package"
            ) from None


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


# --- tensors ------------------------------------------------------------------------------------
def _plan_tensors(path, spec: ArchSpec, reader, config: dict) -> list[tuple[Any, str, str | None]]:
    """(GGUF tensor, HF name, block-local GGUF name or None) for each tensor, checked before writing.

    GGUFError names the first tensor the tables do not know, or the first expected one missing.
    """
    plan = []
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if t.name in spec.global_tensors:
            plan.append((t, spec.global_tensors[t.name], None))
        elif m and m.group(2) in spec.block_tensors:
            plan.append((t, f"model.layers.{m.group(1)}.{spec.block_tensors[m.group(2)]}", m.group(2)))
        else:
            raise GGUFError(
                f"{path.name}: tensor {t.name!r} has no Hugging Face name for {spec.model_type}; this "
                "variant is not supported yet (add the name to its ArchSpec tensor tables)"
            )
    expected = {hf for g, hf in spec.global_tensors.items() if g != "output.weight"}  # lm_head may be tied
    layers, per_block = range(config["num_hidden_layers"]), spec.block_tensors.values()
    expected |= {f"model.layers.{i}.{hf}" for i in layers for hf in per_block}
    if missing := sorted(expected - {hf for _, hf, _ in plan}):
        raise GGUFError(f"{path.name}: {len(missing)} tensor(s) missing, e.g. {missing[0]}; file incomplete")
    return plan


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: `[n_heads * head_dim, d_model]` in and out.

    HF's RoPE rotates the pairs (j, j + head_dim/2) of a head (`rotate_half`); llama.cpp's rotates
    adjacent pairs (2j, 2j + 1). So its converter moved, within each head h, the HF row
    `h*head_dim + half*head_dim/2 + j` to the GGUF row `h*head_dim + 2*j + half` (half in {0, 1}):
    HF rows viewed as `[n_heads, 2, head_dim/2]`, axes 1 and 2 swapped. We view the GGUF rows as
    `[n_heads, head_dim/2, 2]` and swap them back.
    """
    rows = w.shape[0]
    w = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # [n_heads, head_dim/2, 2, d_model]
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(rows, *w.shape[3:]))  # [n_heads*head_dim, d_model]


def _convert_tensors(path, spec: ArchSpec, reader, plan, config: dict, progress: bool) -> dict[str, np.ndarray]:
    """Dequantize every planned tensor to float32 under its HF name, in HF's `[out, in]` layout."""
    from rich.progress import track

    out: dict[str, np.ndarray] = {}
    for t, hf_name, local in track(plan, f"dequantizing {path.name}", transient=True, disable=not progress):
        # GGUF lists dims fastest-varying first ([in, out]); NumPy/HF order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        w = read_tensor(reader, t, path).reshape(shape)  # a float32 copy, in this machine's byte order
        if local in spec.rope_permuted:
            w = _unpermute_rope_rows(w, config[spec.rope_permuted[local]])
        if spec.norm_shift and t.name.endswith("norm.weight"):
            w -= np.float32(spec.norm_shift)  # llama.cpp stored 1 + w (Gemma's multiplier); HF wants w
        out[hf_name] = w
    return out


# --- packed tensors, for running from the GGUF itself (weight_dtype="gguf") ----------------------
@dataclass
class PackedTensor:
    """One GGUF tensor as stored, under its Hugging Face name: its blocks kept packed.

    ``data`` is uint8 ``[rows, row_bytes]`` in the tensor's GGUF type ``type_name`` (``"Q4_1"``,
    ``"F32"``, ...), ``shape`` the HF ``[out, in]`` (or ``[dim]``) shape of its values. Rows of
    llama-family q/k are already put back in HF's order: blocks run along a row, so moving whole
    packed rows is exact. The bytes are a copy, not a view of the memory-mapped file.
    """

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 [rows, row_bytes]
    norm_shift: float = 0.0  # subtract from the values to get HF's (Gemma's norms: 1 + w -> w)

    def to_float32(self) -> np.ndarray:
        """The values as float32 in ``shape``, computed as ``import_gguf`` writes them (the same bits)."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.type_name]
        w = dequantize_rows(self.data, qtype).reshape(self.shape)
        if self.norm_shift:
            w -= np.float32(self.norm_shift)
        return w


def read_packed_tensors(gguf_path: str | os.PathLike) -> tuple[dict[str, PackedTensor], str]:
    """Every tensor of a GGUF file, packed, by Hugging Face name; and the file's architecture.

    Raises:
        GGUFError: not a GGUF, truncated, an unsupported architecture, or a tensor without an HF name.
    """
    import gguf

    path = pathlib.Path(gguf_path)
    try:
        meta, infos, data_start = _scan_gguf(path)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise _unreadable(path, exc) from exc
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    spec = ARCHITECTURES[arch]
    n_heads = meta[f"{arch}.attention.head_count"]
    heads = {
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", n_heads),
    }
    # One owned copy per tensor, taken from a read-only map of the file: q/k rows are gathered in
    # HF's order as they are copied (a second copy, freed after, would stay in the heap as holes).
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, type_id, dims, offset in infos:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(dims[1:], dtype=np.int64))  # GGUF dims are fastest first: [in, out]
        row_bytes = dims[0] // block * type_size
        start = data_start + offset
        if start + rows * row_bytes > mm.size:
            raise GGUFError(f"{path.name}: tensor {name!r} runs past the end of the file; it is truncated")
        tensors.append(_TensorInfo(name, qtype, dims, mm[start : start + rows * row_bytes].reshape(rows, row_bytes)))
    out = {}
    for t, hf_name, local in _plan_tensors(
        path, spec, _Tensors(tensors), {"num_hidden_layers": meta[f"{arch}.block_count"]}
    ):
        shape = tuple(reversed(t.shape))  # [out, in] (or [dim])
        if local in spec.rope_permuted:
            order = _unpermute_rope_rows(np.arange(len(t.data))[:, None], heads[spec.rope_permuted[local]])[:, 0]
            data = np.asarray(t.data[order])  # HF row i is GGUF row order[i]
        else:
            data = np.array(t.data)
        shift = spec.norm_shift if t.name.endswith("norm.weight") else 0.0
        out[hf_name] = PackedTensor(t.name, t.tensor_type.name, shape, data, shift)
    del tensors, mm
    return out, arch


@dataclass
class _TensorInfo:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest first
    data: np.ndarray  # uint8 [rows, row_bytes]


@dataclass
class _Tensors:
    tensors: list[_TensorInfo]


# GGUF value types (gguf's GGUFValueType): struct format per scalar type; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _scan_gguf(path: pathlib.Path) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...], int]], int]:
    """Read a GGUF header without the big arrays: (scalar and string metadata, tensor infos
    ``(name, type id, dims fastest first, offset)``, where the tensor data starts).

    The layout (ggml's ``docs/gguf.md``): magic, version u32, tensor count u64, key/value count u64;
    each key/value: string key, type u32, value; each tensor: string name, n_dims u32, dims u64,
    type u32, offset u64; the data after, aligned to ``general.alignment`` (32 by default). Strings
    are u64 length + UTF-8; arrays are element type u32 + count u64 + elements (skipped here:
    ``gguf.GGUFReader`` makes Python objects of Gemma's 262,144 token strings, 25 s of a load).
    """
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file; pass a .gguf file")
    pos = 4
    raw = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))  # the header can be megabytes (the vocabulary)

    def unpack(fmt: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, raw, pos)[0]
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = unpack("Q")
        pos += n
        return bytes(raw[pos - n : pos]).decode("utf-8")

    def skip(type_id: int) -> None:
        nonlocal pos
        if type_id == 8:
            n = unpack("Q")  # read before `pos +=`: unpack moves pos itself
            pos += n
        elif type_id == 9:
            inner, count = unpack("I"), unpack("Q")
            if inner in _SCALARS:
                pos += count * struct.calcsize("<" + _SCALARS[inner])
            else:
                for _ in range(count):
                    skip(inner)
        else:
            pos += struct.calcsize("<" + _SCALARS[type_id])

    unpack("I")  # version
    n_tensors, n_kv = unpack("Q"), unpack("Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, type_id = string(), unpack("I")
        if type_id == 8:
            meta[key] = string()
        elif type_id in _SCALARS:
            meta[key] = unpack(_SCALARS[type_id])
        else:
            skip(type_id)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), unpack("I")
        dims = tuple(unpack("Q") for _ in range(n_dims))
        infos.append((name, unpack("I"), dims, unpack("Q")))
    align = int(meta.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    return meta, infos, data_start


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


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
