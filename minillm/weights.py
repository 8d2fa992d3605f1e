"""Weights: safetensors files -> float32 NumPy arrays in one internal layout.

Every family's Hugging Face tensor names are mapped here onto the same :class:`Weights` layout, so
``model.py`` has one forward pass. Projections are stored *pre-transposed* as ``[in, out]`` so the
forward reads ``x @ W`` like the textbook, and q/k/v (and gate/up) are concatenated at load so each
is one contiguous matrix multiply.

HF stores ``nn.Linear`` weights as ``[out, in]``; we transpose once here, never per token.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open

from .config import ModelConfig
from .errors import WeightsError


@dataclass
class LayerWeights:
    """One decoder block. Shapes use d = hidden_size, f = intermediate_size."""

    attn_norm: np.ndarray  # [d]
    w_qkv: np.ndarray  # [d, q_dim + 2 * kv_dim]   (q | k | v)
    w_o: np.ndarray  # [q_dim, d]
    mlp_norm: np.ndarray  # [d]
    w_gate_up: np.ndarray  # [d, 2 * f]              (gate | up)
    w_down: np.ndarray  # [f, d]


@dataclass
class Weights:
    """All parameters, float32, plus bookkeeping for the trace."""

    embed_tokens: np.ndarray  # [vocab, d]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [d]
    lm_head: np.ndarray  # [d, vocab]; a transposed *view* of embed_tokens when tied
    stored_dtypes: Counter = field(default_factory=Counter)  # {"F32": n_params, ...} as on disk
    stored_bytes: Counter = field(default_factory=Counter)  # {"F32": bytes, ...} as on disk
    unused_tensors: list[str] = field(default_factory=list)  # in the files, not needed
    files: list[Path] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # {"read": s, "convert": s}

    def arrays(self):
        """Yield every distinct parameter array once (a tied head is not counted twice)."""
        yield self.embed_tokens
        for layer in self.layers:
            yield from (layer.attn_norm, layer.w_qkv, layer.w_o, layer.mlp_norm, layer.w_gate_up, layer.w_down)
        yield self.final_norm
        if not np.shares_memory(self.lm_head, self.embed_tokens):
            yield self.lm_head

    @property
    def num_parameters(self) -> int:
        return sum(a.size for a in self.arrays())

    @property
    def nbytes(self) -> int:
        """Bytes held in memory as loaded (float32)."""
        return sum(a.nbytes for a in self.arrays())


# Hugging Face names per family; "{i}" is the layer index.
LLAMA_NAMES = {
    "embed_tokens": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
NAME_MAPS = {"llama": LLAMA_NAMES}


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model folder: the shards named by
    ``model.safetensors.index.json`` if present, else every ``*.safetensors``.

    Raises:
        WeightsError: no safetensors file; only pickle files (``.bin``/``.pt``), which minillm
            never loads because unpickling runs code; an index naming a missing shard or a path
            outside the folder.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise WeightsError(f"{index} is not a valid shard index ({exc}); re-download the model.") from exc
        files = []
        for name in shard_names:
            path = (folder / name).resolve()
            if folder.resolve() not in path.parents:
                raise WeightsError(f"{index} names {name!r}, outside the model folder; refusing to read it.")
            if not path.is_file():
                raise WeightsError(f"{index} names shard {name!r}, which is missing from {folder}; re-download it.")
            files.append(path)
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise WeightsError(
                f"{folder} has only pickle weights ({', '.join(pickles)}); minillm never unpickles "
                "(it can run code). Convert them to safetensors or download the safetensors files."
            )
        raise WeightsError(f"no *.safetensors weights in {folder}; download the model's weights.")
    return files


def _read_tensors(files: list[Path]) -> tuple[dict[str, np.ndarray], Counter, Counter]:
    """Read every tensor as a NumPy array, counting parameters and bytes per stored dtype."""
    tensors: dict[str, np.ndarray] = {}
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():
                    array = f.get_tensor(name)
                    dtype = str(array.dtype)
                    counts[dtype] += array.size
                    nbytes[dtype] += array.nbytes
                    tensors[name] = array
        except (OSError, ValueError, RuntimeError, TypeError) as exc:
            raise WeightsError(
                f"cannot read {file} ({type(exc).__name__}: {exc}); the file is corrupt, truncated "
                "or in a dtype minillm does not read. Re-download it."
            ) from exc
    return tensors, counts, nbytes


def load_weights(folder: str | os.PathLike, config: ModelConfig) -> Weights:
    """Load a model folder's safetensors into the internal float32 layout.

    Returns:
        Weights with projections pre-transposed to ``[in, out]`` and fused (q|k|v, gate|up).

    Raises:
        WeightsError: unreadable file, a tensor missing, or a tensor of the wrong shape (the
            message names the tensor, the expected and the found shape).
    """
    names = NAME_MAPS[config.model_type]
    t0 = time.perf_counter()
    files = weight_files(folder)
    tensors, counts, nbytes = _read_tensors(files)
    t1 = time.perf_counter()
    used: set[str] = set()

    d, f, vocab = config.hidden_size, config.intermediate_size, config.vocab_size

    def take(key: str, shape: tuple[int, ...], i: int | None = None) -> np.ndarray:
        name = names[key].format(i=i)
        if name not in tensors:
            raise WeightsError(
                f"tensor {name!r} is missing from {Path(folder)}; the checkpoint is incomplete or "
                f"not a {config.model_type} model. Re-download it."
            )
        array = tensors[name]
        if tuple(array.shape) != shape:
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(array.shape)}, expected {shape} from config.json; "
                "the weights and config.json belong to different models."
            )
        used.add(name)
        return array.astype(np.float32, copy=False)

    def linear(key: str, out_dim: int, in_dim: int, i: int) -> np.ndarray:
        return take(key, (out_dim, in_dim), i)  # HF nn.Linear layout: [out, in]

    layers = []
    for i in range(config.num_hidden_layers):
        q = linear("q", config.q_dim, d, i)
        k = linear("k", config.kv_dim, d, i)
        v = linear("v", config.kv_dim, d, i)
        gate = linear("gate", f, d, i)
        up = linear("up", f, d, i)
        layers.append(
            LayerWeights(
                attn_norm=take("attn_norm", (d,), i),
                # [q_dim + 2 kv_dim, d] -> [d, q_dim + 2 kv_dim]: one GEMM gives q, k and v
                w_qkv=np.ascontiguousarray(np.concatenate([q, k, v], axis=0).T),
                w_o=np.ascontiguousarray(linear("o", d, config.q_dim, i).T),  # [q_dim, d]
                mlp_norm=take("mlp_norm", (d,), i),
                w_gate_up=np.ascontiguousarray(np.concatenate([gate, up], axis=0).T),  # [d, 2f]
                w_down=np.ascontiguousarray(linear("down", d, f, i).T),  # [f, d]
            )
        )
    embed = np.ascontiguousarray(take("embed_tokens", (vocab, d)))
    if config.tie_word_embeddings:
        if names["lm_head"] in tensors:
            used.add(names["lm_head"])  # some files carry the tied copy anyway; it equals embed
        lm_head = embed.T  # tied head: a [d, vocab] view, no second copy
    else:
        lm_head = np.ascontiguousarray(take("lm_head", (vocab, d)).T)  # [d, vocab]
    final_norm = take("final_norm", (d,))
    t2 = time.perf_counter()
    return Weights(
        embed_tokens=embed,
        layers=layers,
        final_norm=final_norm,
        lm_head=lm_head,
        stored_dtypes=counts,
        stored_bytes=nbytes,
        unused_tensors=sorted(set(tensors) - used),
        files=files,
        seconds={"read": t1 - t0, "convert": t2 - t1},
    )
