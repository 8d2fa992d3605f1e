"""The memory plan: what a model will hold, computed from its config before any weight byte is read.

vLLM sizes its KV cache from what the weights and a profiling pass leave of the GPU's memory;
ollama estimates a model's footprint before it loads it. minillm does the same on the CPU, with
numbers that come from the model's ``config.json`` and the chosen precisions, never a guess::

    weights       every matrix at weight_dtype (held.py's formats), norms and biases float32
    KV pool       num_blocks * block_size positions * kv_bytes_per_token (``ModelConfig.kv_bytes_per_token``)
    activations   the largest batch step's intermediates: max_batched_tokens rows through one layer,
                  a full-context prefill chunk's scores, max_num_seqs decode rows' gathered keys, logits
    tokenizer     measured: what a subprocess holds once it read and used it, freed memory trimmed (cached)
    runtime       measured: the RSS of a process that imported NumPy and minillm (cached)

The weights' bytes per format::

    float32     rows * cols * 4
    bfloat16    rows * cols * 2
    int8        rows * cols * 1 + rows * 4      (one float32 scale per output row)
    gguf        each tensor's blocks as the file packs them, sized from its header (gguf_plan.py)

With a budget and no KV size given, the pool gets what the budget leaves once everything else is
counted; a model whose weights plus one full-context request cannot fit is refused with the numbers.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from minillm.errors import InvalidRequestError, MemoryBudgetError
from minillm.model.config import MlpKind, ModelConfig, NormKind, PositionKind
from minillm.model.paged_kv_cache import blocks_for
from minillm.runtime.overhead import measured_overhead, rss_bytes, trim_heap  # noqa: F401  (re-exported)

MIB, GIB = 2**20, 2**30
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": MIB, "mib": MIB, "g": GIB, "gib": GIB, "kb": 10**3}
_UNITS |= {"mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """``"2GiB"`` -> 2147483648 bytes. Units: B, KiB, MiB, GiB (binary), KB, MB, GB (decimal); none: bytes.

    Raises:
        InvalidRequestError: not a positive number with one of these units.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise InvalidRequestError(
            f"{text!r} is not a memory size; write a positive number with a unit, e.g. 512MiB or 2GiB "
            "(units: B, KiB, MiB, GiB, KB, MB, GB)."
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``1536 * 2**20`` -> ``"1.50 GiB"``; below a GiB in MiB."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


# --- the parts of the plan ------------------------------------------------------------------------
def _matrix_bytes(rows: int, cols: int, weight_dtype: str) -> int:
    if weight_dtype == "float32":
        return rows * cols * 4
    if weight_dtype == "bfloat16":
        return rows * cols * 2
    if weight_dtype == "int8":
        return rows * cols + rows * 4
    raise InvalidRequestError(
        f"the config sizes weights at float32, bfloat16 and int8, not {weight_dtype!r}; at 'gguf' the "
        "file's header does: pass make_plan(..., weights=gguf_plan.gguf_weight_bytes(path, config))."
    )


def weight_bytes(config: ModelConfig, weight_dtype: str = "float32") -> dict[str, int]:
    """``{format: bytes}`` of the weights as ``load(..., weight_dtype=...)`` will hold them.

    Matrices (q|k|v, o, gate|up or up, down, the embedding, an untied LM head) take ``weight_dtype``;
    norms, biases and learned positions stay ``"float32"``. Equal to ``Weights.formats()`` after a load.

    Raises:
        InvalidRequestError: a ``weight_dtype`` other than float32, bfloat16, int8.
    """
    d, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv, hd = config.q_dim, config.kv_dim, config.head_dim
    gated = config.mlp is MlpKind.GATED
    shapes = [(q + 2 * kv, d), (d, q), ((2 if gated else 1) * ffn, d), (d, ffn)]
    layer = sum(_matrix_bytes(r, c, weight_dtype) for r, c in shapes)
    vectors = 2 * d  # attention and MLP norms
    vectors += 2 * d if config.norm is NormKind.LAYERNORM else 0
    vectors += (q + 2 * kv) if config.qkv_bias else 0
    vectors += 2 * hd if config.qk_norm else 0
    vectors += d if config.o_bias else 0
    vectors += 2 * d if config.post_norms else 0
    vectors += ((2 if gated else 1) * ffn + d) if config.mlp_bias else 0
    matrices = config.num_hidden_layers * layer
    matrices += _matrix_bytes(vocab, d, weight_dtype) * (1 if config.tie_word_embeddings else 2)
    floats = config.num_hidden_layers * vectors + d * (2 if config.norm is NormKind.LAYERNORM else 1)
    if config.position_embedding is PositionKind.LEARNED:
        floats += config.max_position_embeddings * d
    out: Counter = Counter({weight_dtype: matrices})
    out["float32"] += floats * 4
    return dict(out)


def activation_bytes(config: ModelConfig, *, max_batched_tokens: int, max_num_seqs: int, context: int) -> int:
    """Bytes of float32 intermediates alive at once in the largest batch step (an upper bound).

    ``rows = max_batched_tokens`` rows go through a layer: the residual stream and its norm
    ``[rows, d_model]`` x 2 and q|k|v ``[rows, q + 2 kv]``, plus the largest of
    - a prefill chunk of ``rows`` positions at the end of a full context: scores and probabilities
      ``[n_heads, rows, context]`` x 2, its mask ``[rows, context]``, its keys and values gathered
      ``[n_kv_heads, context, head_dim]`` x 2;
    - ``max_num_seqs`` decode rows, each gathering ``[n_kv_heads, context, head_dim]`` keys and values;
    - the MLP: gate|up ``[rows, 2 ffn]`` and the activation ``[rows, ffn]`` x 2;
    and the logits ``[max_num_seqs, vocab]`` x 2 (the head's output and sampling's copy).
    """
    rows, ctx = max_batched_tokens, context
    d, ffn, q, kv = config.hidden_size, config.intermediate_size, config.q_dim, config.kv_dim
    stream = rows * (2 * d + q + 2 * kv)
    prefill = 2 * config.num_attention_heads * rows * ctx + rows * ctx + 2 * kv * ctx
    decode = max_num_seqs * 2 * kv * ctx + max_num_seqs * config.num_attention_heads * ctx * 2
    mlp = rows * 4 * ffn
    logits = 2 * max_num_seqs * config.vocab_size
    return 4 * (stream + max(prefill, decode, mlp) + logits)


# --- measured once: the runtime's own bytes and a tokenizer's -------------------------------------
# --- the plan -------------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """One model's memory, part by part (bytes), as planned before its load.

    ``total`` counts the runtime's own bytes too (a model alone in a process); ``model_bytes``
    leaves them out (what one more model adds to a process already running).
    """

    model: str
    weight_dtype: str
    kv_dtype: str
    context: int  # positions one request may use
    weights: dict[str, int]  # format -> bytes
    kv_pool: int
    kv_tokens: int
    kv_bytes_per_token: int
    activations: int
    tokenizer: int
    runtime: int
    budget: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def model_bytes(self) -> int:
        """Weights + KV pool + activations + tokenizer: what loading this model adds."""
        return self.weights_total + self.kv_pool + self.activations + self.tokenizer

    @property
    def total(self) -> int:
        """``model_bytes`` + the runtime's own bytes."""
        return self.model_bytes + self.runtime

    @property
    def max_concurrency(self) -> float:
        """Full-context requests the KV pool holds at once."""
        return self.kv_tokens / self.context

    def kv_line(self) -> str:
        """vLLM's startup line: ``KV cache: N tokens, maximum concurrency at context C: X``."""
        return (
            f"KV cache: {self.kv_tokens:,} tokens, maximum concurrency at context {self.context:,}: "
            f"{self.max_concurrency:.2f}x"
        )

    def rows(self) -> list[tuple[str, int, str]]:
        """``(part, bytes, how it was computed)`` for a table."""
        w = ", ".join(f"{fmt} {format_bytes(n)}" for fmt, n in self.weights.items())
        return [
            ("weights", self.weights_total, w),
            ("KV pool", self.kv_pool, f"{self.kv_tokens:,} tokens x {self.kv_bytes_per_token:,} B ({self.kv_dtype})"),
            ("activations", self.activations, "largest batch step (upper bound)"),
            ("tokenizer", self.tokenizer, "measured once"),
            ("runtime", self.runtime, "measured once: Python + NumPy + minillm"),
            ("total", self.total, "" if self.budget is None else f"budget {format_bytes(self.budget)}"),
        ]

    def to_dict(self) -> dict:
        """Plain JSON data: every field plus the totals and the KV line."""
        d = asdict(self)
        d.update(
            weights_total=self.weights_total,
            model_bytes=self.model_bytes,
            total=self.total,
            max_concurrency=self.max_concurrency,
            kv_line=self.kv_line(),
        )
        return d


def make_plan(
    config: ModelConfig,
    *,
    model: str,
    weight_dtype: str = "float32",
    kv_dtype: str = "float32",
    context: int | None = None,
    max_num_seqs: int = 16,
    max_batched_tokens: int = 512,
    block_size: int = 16,
    kv_cache_mib: float | None = None,
    budget: int | None = None,
    tokenizer: int = 0,
    runtime: int = 0,
    weights: dict[str, int] | None = None,
) -> MemoryPlan:
    """The plan for ``config`` at these precisions and serving limits (bytes throughout).

    Args:
        context: positions one request may use (default: the model's ``max_position_embeddings``).
        kv_cache_mib: the pool's size; None: what ``budget`` leaves (no budget: 512 MiB, the server's default).
        budget: bytes the model may use in all, ``runtime`` included; None: no limit.
        tokenizer, runtime: measured bytes (:func:`measured_overhead`).
        weights: ``{format: bytes}`` when the config cannot size them (``"gguf"``: the file's
            header does, ``gguf_plan.gguf_weight_bytes``); None: :func:`weight_bytes`.

    Raises:
        MemoryBudgetError: with a budget, the weights + activations + tokenizer + runtime + one
            full-context request's KV do not fit; or an explicit pool that passes the budget.
        InvalidRequestError: an unknown ``kv_dtype``, or a ``weight_dtype`` the config cannot size
            without ``weights``.
    """
    context = min(context or config.max_position_embeddings, config.max_position_embeddings)
    weights = dict(weights) if weights is not None else weight_bytes(config, weight_dtype)
    per_token = config.kv_bytes_per_token(kv_dtype)
    per_block = per_token * block_size
    act = activation_bytes(config, max_batched_tokens=max_batched_tokens, max_num_seqs=max_num_seqs, context=context)
    fixed = sum(weights.values()) + act + tokenizer + runtime
    one_request = blocks_for(context, block_size) * per_block
    if kv_cache_mib is None and budget is None:
        kv_cache_mib = 512.0
    if kv_cache_mib is not None:
        pool = int(kv_cache_mib * MIB // per_block) * per_block
    else:
        pool = max(0, (budget - fixed) // per_block * per_block)
    plan = MemoryPlan(
        model=model,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        context=context,
        weights=weights,
        kv_tokens=pool // per_token,
        kv_pool=pool,
        kv_bytes_per_token=per_token,
        activations=act,
        tokenizer=tokenizer,
        runtime=runtime,
    )
    plan.budget = budget
    if budget is not None and (fixed + one_request > budget or fixed + pool > budget):
        what = "one full-context request" if fixed + one_request > budget else f"--kv-cache-mib {kv_cache_mib:g}"
        kv = one_request if fixed + one_request > budget else pool
        raise MemoryBudgetError(
            f"{model} ({weight_dtype}) needs {format_bytes(fixed + kv)}: weights {format_bytes(plan.weights_total)} "
            f"+ activations {format_bytes(act)} + tokenizer {format_bytes(tokenizer)} + runtime "
            f"{format_bytes(runtime)} + KV {format_bytes(kv)} for {what} ({context:,} positions), but the memory "
            f"budget is {format_bytes(budget)}; raise --memory-budget to at least {format_bytes(fixed + kv)}, "
            "or lower --max-seq-len / --kv-cache-mib, or hold the weights at int8."
        )
    return plan
