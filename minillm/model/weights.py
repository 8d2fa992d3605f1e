"""Weights: a checkpoint's tensors -> one internal layout, :class:`Weights`.

Every matrix is a held matrix (``held.py``: float32, or a compact format after :func:`hold_weights`
or from a GGUF's packed blocks); norms and biases are float32 arrays. Every family's Hugging Face
tensor names (``families.NAME_MAPS``) are mapped onto the same :class:`Weights` layout by one
builder, :func:`read_parameters`, so ``transformer.py`` has one forward pass. Projections are stored like
``torch.nn.Linear`` stores them, ``[out, in]``, and the forward reads ``x @ W.T`` (PyTorch's
``F.linear``), so a minillm matrix compares with transformers' tensor directly. q/k/v (and gate/up)
are stacked at load so each is one contiguous matrix multiply.

Why ``[out, in]`` and not the textbook's ``[in, out]``: the files already hold it (nothing to
transpose at load, and a tensor compares with transformers' directly), and in decode each output
is a dot product over one contiguous row.

Three layouts arrive on disk, and each is turned into ours once, at load, never per token (the
reader does it as it takes each tensor: ``tensor_reader.TensorReader``, or ``gguf_weights.py``'s):

- HF ``nn.Linear`` weights are ``[out, in]``: kept.
- GPT-2's ``Conv1D`` weights are ``[in, out]``: transposed. Its ``c_attn`` already fuses q|k|v.
- Gemma's RMSNorm weights ``w`` are applied as ``(1 + w)`` (``Gemma3RMSNorm``): the ``1`` is added
  at load, so ``primitives.rms_norm`` is the same function for every family.

Stored dtypes: float32, float16 and bfloat16 (also float64), from one file or a sharded
checkpoint; ``safetensors_file.py`` reads them with ``safetensors`` (bfloat16 widened to float32 exactly).
A GGUF file (``load(..., weight_dtype="gguf")``) is read by ``gguf_weights.py`` into the same layout.
Tensors a family does not need are left unread and listed in ``Weights.unused_tensors``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from minillm.model.config import ModelConfig
from minillm.model.families import MlpKind, NormKind, PositionKind
from minillm.model.held import HeldMatrix, hold
from minillm.model.kernels import PLAIN
from minillm.model.tensor_reader import TensorReader, WeightBlock, read_tensors
from minillm.sources.safetensors_file import weight_files


@dataclass
class LayerWeights:
    """One decoder block. Shapes: d_model = hidden_size, ffn = intermediate_size; every projection is
    a held matrix (``held.py``: float32 or a compact format) ``[out, in]`` (``torch.nn.Linear``'s
    layout); norms and biases are float32 arrays.

    The optional fields are None in families that lack them.
    """

    attn_norm: np.ndarray  # [d_model]
    w_qkv: HeldMatrix  # [q_dim + 2 * kv_dim, d_model]   (q | k | v rows)
    w_o: HeldMatrix  # [d_model, q_dim]
    mlp_norm: np.ndarray  # [d_model]  (Gemma: pre_feedforward_layernorm)
    w_down: HeldMatrix  # [d_model, ffn]
    w_gate_up: HeldMatrix | None = None  # [2 * ffn, d_model] (gate | up rows), gated MLPs
    w_up: HeldMatrix | None = None  # [ffn, d_model], plain MLP (GPT-2)
    attn_norm_bias: np.ndarray | None = None  # [d_model], LayerNorm (GPT-2)
    mlp_norm_bias: np.ndarray | None = None  # [d_model], LayerNorm (GPT-2)
    b_qkv: np.ndarray | None = None  # [q_dim + 2 * kv_dim] (GPT-2, Qwen 2)
    b_o: np.ndarray | None = None  # [d_model]
    b_gate_up: np.ndarray | None = None  # [2 * ffn]
    b_up: np.ndarray | None = None  # [ffn]
    b_down: np.ndarray | None = None  # [d_model]
    q_norm: np.ndarray | None = None  # [head_dim] (Qwen 3, Gemma 3)
    k_norm: np.ndarray | None = None  # [head_dim]
    attn_post_norm: np.ndarray | None = None  # [d_model] (Gemma 3: post_attention_layernorm)
    mlp_post_norm: np.ndarray | None = None  # [d_model] (Gemma 3: post_feedforward_layernorm)
    # Low-rank paths beside a projection: unmerged LoRA adapters (lora.py), weight field ("w_qkv", ...)
    # -> its active LoraDeltas; ``project`` adds them.
    lora: dict[str, list] = field(default_factory=dict)

    def arrays(self):
        """Yield every parameter of the block, each norm or bias array and each held matrix (skipping
        the absent ones; adapters, the ``lora`` field, not counted)."""
        for f in fields(self):
            if f.name != "lora" and (a := getattr(self, f.name)) is not None:
                yield a

    def project(self, name: str, x: np.ndarray, linear: Callable = PLAIN.linear) -> np.ndarray:
        """``x @ W.T (+ b)`` for projection ``name`` (``"qkv"``, ``"o"``, ``"gate_up"``, ``"up"``,
        ``"down"``): ``x`` ``[seq, in]`` -> ``[seq, out]``, plus the low-rank path of every active
        unmerged LoRA adapter on it (each a :class:`~minillm.model.lora.LoraDelta`, adding
        ``[seq, rows]`` to its own output rows).

        The product is ``linear(x, w, b)``: a forward pass's (``passes.py``: the model's kernels,
        plain by default), handed the matrix and its bias, never the projection's name. However the
        matrix is held (``held.py``: float32, a compact format, a memory-mapped load's parts),
        ``linear`` takes it.
        """
        weight, bias = _PROJECTIONS[name]
        y = linear(x, getattr(self, weight), getattr(self, bias))
        if self.lora:  # unmerged adapters: each adds its path to its own rows
            for path in self.lora.get(weight, ()):
                y[:, path.rows] += path(x)
        return y

    def projections(self):
        """Yield the block's matrices, the ones a token's matrix products stream through:
        ``w_qkv``, ``w_o``, ``w_gate_up`` (or GPT-2's ``w_up``), ``w_down`` (a memory-mapped
        load's fused ones a ``StackedMatrix`` of the file's matrices: their ``parts()`` list them)."""
        for a in (self.w_qkv, self.w_o, self.w_gate_up, self.w_up, self.w_down):
            if a is not None:
                yield a


#: projection name -> its weight and bias fields in LayerWeights
_PROJECTIONS = {name: ("w_" + name, "b_" + name) for name in ("qkv", "o", "gate_up", "up", "down")}


@dataclass
class Weights:
    """All parameters, plus bookkeeping for the trace. Every matrix (embedding and LM head included) is a
    :class:`~minillm.model.held.HeldMatrix`: a ``Float32Matrix`` at ``weight_dtype="float32"``, else the
    compact format's; the norms (and biases) stay float32 arrays."""

    embed_tokens: HeldMatrix  # [vocab, d_model]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [d_model]
    lm_head: HeldMatrix  # [vocab, d_model]; the very matrix embed_tokens when tied
    pos_embed: np.ndarray | None = None  # [max_positions, d_model], learned positions (GPT-2)
    final_norm_bias: np.ndarray | None = None  # [d_model], LayerNorm (GPT-2)
    stored_dtypes: Counter = field(default_factory=Counter)  # {"bfloat16": n_params, ...} as on disk
    stored_bytes: Counter = field(default_factory=Counter)  # {"bfloat16": bytes, ...} as on disk
    unused_tensors: list[str] = field(default_factory=list)  # in the files, not needed
    files: list[Path] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # {"read": bytes -> float32, "convert": layout}
    weight_dtype: str = "float32"  # how the matrices are held: float32 | bfloat16 | int8 | gguf
    mapped: bool = False  # the matrices are read-only views of the files (load(..., mmap=True))

    def arrays(self):
        """Yield every distinct parameter array once (a tied head is not counted twice)."""
        yield self.embed_tokens
        for extra in (self.pos_embed, self.final_norm_bias):
            if extra is not None:
                yield extra
        for layer in self.layers:
            yield from layer.arrays()
        yield self.final_norm
        if not self.tied:
            yield self.lm_head

    @property
    def tied(self) -> bool:
        """True when the LM head is the embedding itself (one matrix, counted once)."""
        return self.lm_head is self.embed_tokens

    @property
    def num_parameters(self) -> int:
        return sum(a.size for a in self.arrays())

    @property
    def nbytes(self) -> int:
        """Bytes held in memory as loaded (whatever each matrix's format); with ``mapped``, the file's
        pages they view, resident only once the forward has touched them."""
        return sum(a.nbytes for a in self.arrays())

    def formats(self) -> dict[str, tuple[int, int]]:
        """``{format: (parameters, bytes)}`` as held now: ``"float32"`` for arrays (norms) and float32
        matrices, else each held matrix's format (``"int8"``, ``"Q4_1"``, ``"Q8_0"``, ...), the parts
        of a stacked q|k|v each under its own."""
        out: Counter = Counter()
        sizes: Counter = Counter()
        for a in self.arrays():
            for part in a.parts() if isinstance(a, HeldMatrix) else [a]:  # a matrix's parts, or a norm
                name = str(part.dtype)
                out[name] += part.size
                sizes[name] += part.nbytes
        return {name: (out[name], sizes[name]) for name in out}


def hold_weights(weights: Weights, weight_dtype: str) -> Weights:
    """Re-hold every matrix of float32 ``weights`` at ``weight_dtype`` (``"bfloat16"`` or ``"int8"``),
    in place; norms and biases stay float32. The float32 block is released once nothing views it.

    The embedding is held too (its rows are looked up, or, tied, multiplied as the LM head).
    """
    if weight_dtype == "float32":
        return weights
    for layer in weights.layers:
        for name in ("w_qkv", "w_o", "w_gate_up", "w_up", "w_down"):
            if (w := getattr(layer, name)) is not None:
                setattr(layer, name, hold(w, weight_dtype))
    tied = weights.tied
    weights.embed_tokens = hold(weights.embed_tokens, weight_dtype)
    weights.lm_head = weights.embed_tokens if tied else hold(weights.lm_head, weight_dtype)
    weights.weight_dtype = weight_dtype
    return weights


def load_weights(folder: str | os.PathLike, config: ModelConfig, mmap: bool = False) -> Weights:
    """Load a model folder's safetensors into the internal float32 layout.

    With ``mmap=True`` nothing is copied: every matrix is a read-only view of the file as it lays
    them out (llama.cpp's default), paged in by the kernel when the forward first touches it, so
    the first request pays the page-ins (a warm-up pays them before "ready"). The fused q|k|v and
    gate|up become a ``held.StackedMatrix`` of the file's separate matrices (its ``parts()``), one
    product each.
    Only float32 files map: any other dtype would need a converted copy.

    Returns:
        Weights with projections ``[out, in]`` and fused (q|k|v, gate|up), norms
        with Gemma's ``1 +`` folded in, and ``unused_tensors``: names in the files this family
        does not need (e.g. a GPT-2 ``attn.bias`` mask buffer), ignored.

    Raises:
        WeightsError: unreadable file, a tensor missing, a tensor of the wrong shape (the message
            names the tensor, the expected and the found shape), or one stored in a dtype minillm
            does not read (with ``mmap=True``: any dtype but float32).
    """
    t0 = time.perf_counter()
    files = weight_files(folder)
    tensors, counts, nbytes = read_tensors(files)
    headers_s = time.perf_counter() - t0
    r = TensorReader(folder, config, tensors, WeightBlock(0 if mmap else _block_size(config)), mmap)
    parameters = read_parameters(r, config)
    reading_s = headers_s + r.reading_s  # the headers, then each tensor's bytes as it was taken
    return Weights(
        **parameters,
        unused_tensors=sorted(set(tensors) - r.used),
        seconds={"map" if mmap else "read": reading_s, "convert": time.perf_counter() - t0 - reading_s},
        stored_dtypes=counts,
        stored_bytes=nbytes,
        files=files,
        mapped=mmap,
    )


def _block_size(config: ModelConfig) -> int:
    """float32 values of every matrix a load copies: the embedding (and an untied head), every layer's."""
    d_model, ffn, q_dim, kv_dim = config.hidden_size, config.intermediate_size, config.q_dim, config.kv_dim
    gated = config.mlp is MlpKind.GATED
    per_layer = (q_dim + 2 * kv_dim) * d_model + d_model * q_dim + (2 if gated else 1) * ffn * d_model + d_model * ffn
    tables = config.vocab_size * d_model * (1 if config.tie_word_embeddings else 2)
    return tables + config.num_hidden_layers * per_layer


def read_parameters(r, config: ModelConfig) -> dict:
    """The model's parameters as :class:`Weights` fields (``embed_tokens``, ``layers``, ``lm_head``,
    ``pos_embed``, ``final_norm``, ``final_norm_bias``), read through ``r``: the one builder of both
    loads. ``r`` is a :class:`~minillm.model.tensor_reader.TensorReader` (safetensors: float32 copies
    or mapped views) or ``gguf_weights``' packed reader (every matrix a ``BlockMatrix``); each reader
    decides how a matrix is held and offers ``table``, ``matrix``, ``take``, ``maybe``, ``norm``, ``find``.

    Raises:
        WeightsError: (the reader's) a tensor missing, of the wrong shape or of an unreadable dtype.
    """
    d_model, vocab = config.hidden_size, config.vocab_size
    # The largest tensor first: while it is read, its mapped file pages and its copy both count in
    # the resident set, and this way nothing else is loaded yet (peak RSS).
    embed = r.table("embed_tokens", vocab, d_model)
    layers = [layer_weights(r, config, i) for i in range(config.num_hidden_layers)]
    head = r.find("lm_head", None)
    if config.tie_word_embeddings or (head is None and r.omits_tied_head):
        if head is not None:
            r.used.add(head)  # some files carry the tied copy anyway; the model uses the embedding
        lm_head = embed  # tied head: the embedding itself, no second copy
    else:
        lm_head = r.table("lm_head", vocab, d_model)  # [vocab, d_model]
    learned = config.position_embedding is PositionKind.LEARNED
    return dict(
        embed_tokens=embed,
        layers=layers,
        lm_head=lm_head,
        pos_embed=r.maybe(learned, "pos_embed", (config.max_position_embeddings, d_model)),
        final_norm=r.norm("final_norm", d_model),
        final_norm_bias=r.maybe(config.norm is NormKind.LAYERNORM, "final_norm_bias", (d_model,)),
    )


def layer_weights(r, config: ModelConfig, i: int) -> LayerWeights:
    """Layer ``i``'s tensors through the reader ``r`` (see :func:`read_parameters`), taken in the order
    the forward reads them: q|k|v, o, gate|up (or up), down; a family's absent tensors are None."""
    d_model, ffn, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_dim, kv_dim = config.q_dim, config.kv_dim
    if "qkv" in r.names:  # GPT-2: one fused Conv1D [d_model, 3 d_model]
        w_qkv = r.matrix(i, d_model, ("qkv", q_dim + 2 * kv_dim))
        b_qkv = r.maybe(config.qkv_bias, "qkv_bias", (q_dim + 2 * kv_dim,), i)
    else:  # q | k | v rows: one matrix multiply gives all three
        w_qkv = r.matrix(i, d_model, ("q", q_dim), ("k", kv_dim), ("v", kv_dim))
        b_qkv = (
            np.concatenate(
                [r.take("q_bias", (q_dim,), i), r.take("k_bias", (kv_dim,), i), r.take("v_bias", (kv_dim,), i)]
            )
            if config.qkv_bias
            else None
        )
    w_o = r.matrix(i, q_dim, ("o", d_model))  # [d_model, q_dim]
    w_gate_up = w_up = b_gate_up = b_up = None
    if config.mlp is MlpKind.GATED:
        w_gate_up = r.matrix(i, d_model, ("gate", ffn), ("up", ffn))  # gate | up rows
        b_gate_up = (
            np.concatenate([r.take("gate_bias", (ffn,), i), r.take("up_bias", (ffn,), i)]) if config.mlp_bias else None
        )
    else:
        w_up = r.matrix(i, d_model, ("up", ffn))  # [ffn, d_model]
        b_up = r.maybe(config.mlp_bias, "up_bias", (ffn,), i)
    w_down = r.matrix(i, ffn, ("down", d_model))  # [d_model, ffn]
    layernorm = config.norm is NormKind.LAYERNORM
    return LayerWeights(
        attn_norm=r.norm("attn_norm", d_model, i),
        attn_norm_bias=r.maybe(layernorm, "attn_norm_bias", (d_model,), i),
        w_qkv=w_qkv,
        b_qkv=b_qkv,
        q_norm=r.norm("q_norm", hd, i) if config.qk_norm else None,
        k_norm=r.norm("k_norm", hd, i) if config.qk_norm else None,
        w_o=w_o,
        b_o=r.maybe(config.o_bias, "o_bias", (d_model,), i),
        attn_post_norm=r.norm("attn_post_norm", d_model, i) if config.post_norms else None,
        mlp_norm=r.norm("mlp_norm", d_model, i),
        mlp_norm_bias=r.maybe(layernorm, "mlp_norm_bias", (d_model,), i),
        w_gate_up=w_gate_up,
        b_gate_up=b_gate_up,
        w_up=w_up,
        b_up=b_up,
        w_down=w_down,
        b_down=r.maybe(config.mlp_bias, "down_bias", (d_model,), i),
        mlp_post_norm=r.norm("mlp_post_norm", d_model, i) if config.post_norms else None,
    )
