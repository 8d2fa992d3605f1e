"""ModelConfig: a model's shape and family flags, normalised from Hugging Face ``config.json``.

Field names follow Hugging Face (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
``rope_theta``, ...) so a student can put the two files side by side. Family differences are
*flags* here (norm kind, position encoding, biases, QK-norm, MLP kind, sliding windows, ...), read
by the one forward pass in ``model.py``; they are never a second copy of it.

What sets each family apart, and where transformers says so (``models/<family>/modeling_*.py`` and
``configuration_*.py``), is in :data:`SUPPORTED_FAMILIES`.

Two dialects of config.json exist (see DESIGN.md, "Known traps"): hub checkpoints carry
``rope_theta`` / ``rope_scaling`` (Gemma 3 also ``rope_local_base_freq``); transformers 5 writes
``rope_parameters``, flat or, for Gemma 3, one entry per layer type (``full_attention``,
``sliding_attention``). Both are read. GPT-2 spells its sizes ``n_embd``, ``n_layer``, ``n_head``,
``n_positions``, ``n_inner``; those are read too.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

#: config.json "model_type" -> (minillm family, what sets it apart).
SUPPORTED_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "RMSNorm, RoPE (half-split, optional llama3 scaling), GQA, SwiGLU MLP"),
    "gpt2": ("gpt2", "learned positions, LayerNorm with bias, biased fused attention and MLP, GELU (tanh)"),
    "qwen2": ("qwen2", "Llama plus biases on q, k and v"),
    "qwen3": ("qwen3", "Llama plus per-head RMSNorm on q and k before RoPE, head_dim from the config"),
    "gemma3_text": ("gemma3", "RMSNorm (1 + w), scaled embeddings, QK-norm, pre/post norms, GeGLU, "
                              "sliding-window layers with their own RoPE base"),
}

FULL, SLIDING = "full_attention", "sliding_attention"  # layer kinds, as transformers names them
_ROPE_TYPES = ("default", "linear", "llama3")  # implemented in layers.rope_inverse_frequencies
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh"}  # HF name -> layers.ACTIVATIONS key


@dataclass(frozen=True)
class ModelConfig:
    """The numbers that fix a model's shapes, plus the flags that pick its family's variant.

    Shapes that follow: embeddings ``[vocab_size, hidden_size]``; per layer q ``[num_attention_heads
    * head_dim]``, k and v ``[num_key_value_heads * head_dim]``; MLP ``[hidden_size,
    intermediate_size]``. ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (Qwen 3 and
    Gemma 3 set it independently). The defaults of the flags describe a Llama.
    """

    model_type: str
    vocab_size: int
    hidden_size: int  # d_model
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    family: str = "llama"
    # --- norms ---
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm" (GPT-2: with bias)
    norm_eps: float = 1e-6  # HF rms_norm_eps (GPT-2: layer_norm_epsilon)
    norm_weight_offset: float = 0.0  # Gemma stores w and multiplies by (1 + w): offset 1.0
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen 3, Gemma 3)
    post_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 3)
    # --- positions ---
    position_embedding: str = "rope"  # "rope" | "learned" (GPT-2's wpe table)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}; None = plain
    rope_local_theta: float | None = None  # RoPE base of sliding-window layers (Gemma 3); None = rope_theta
    # --- attention ---
    qkv_bias: bool = False
    o_bias: bool = False
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5, not head_dim ** -0.5
    sliding_window: int | None = None  # keys a sliding-window layer sees (itself included)
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () = all FULL
    # --- MLP, embeddings, head ---
    mlp: str = "gated"  # "gated" (SwiGLU / GeGLU) | "plain" (GPT-2: up, act, down)
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    mlp_bias: bool = False
    embed_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # --- derived sizes -------------------------------------------------------------------------
    @property
    def num_key_value_groups(self) -> int:
        """Query heads that share one key/value head (GQA); 1 is plain multi-head attention."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """What ``q . k`` is multiplied by: ``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_type(self, i: int) -> str:
        """``"full_attention"`` or ``"sliding_attention"`` for layer ``i``."""
        return self.layer_types[i] if self.layer_types else FULL

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """KV-cache bytes one position costs: ``2 (k and v) * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element

    def summary(self) -> dict[str, Any]:
        """The rows a trace shows at load: the shapes, then the flags that set this family apart.

        Every model shows family, sizes, norm, positions and MLP; a flag appears only when it
        differs from a plain Llama (biases, QK-norm, post-norms, embedding scale, attention scale,
        sliding windows, soft-capping, RoPE scaling), so the rows that show *are* the differences.
        """
        rows: dict[str, Any] = {
            "family": self.family if self.family == self.model_type else f"{self.family} ({self.model_type})",
            "layers": self.num_hidden_layers,
            "d_model": self.hidden_size,
            "heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "ffn": self.intermediate_size,
            "vocab": self.vocab_size,
            "context": self.max_position_embeddings,
        }
        norm = "LayerNorm (with bias)" if self.norm == "layernorm" else "RMSNorm"
        rows["norm"] = norm + (" x (1 + w)" if self.norm_weight_offset else "") + f", eps {self.norm_eps:g}"
        if self.position_embedding == "learned":
            rows["positions"] = f"learned table [{self.max_position_embeddings}, {self.hidden_size}]"
        else:
            rows["positions"] = f"RoPE theta {self.rope_theta:g}"
            if self.rope_scaling:
                rows["rope_scaling"] = ", ".join(f"{k} {v}" for k, v in self.rope_scaling.items())
            if self.rope_local_theta is not None and SLIDING in self.layer_types:
                rows["rope_local_theta"] = f"{self.rope_local_theta:g} (sliding layers)"
        act = {"silu": "SiLU", "gelu_tanh": "GELU tanh"}.get(self.hidden_act, self.hidden_act)
        glu = {"silu": "SwiGLU", "gelu_tanh": "GeGLU"}.get(self.hidden_act, f"gated {act}")
        rows["mlp"] = glu if self.mlp == "gated" else f"up, {act}, down"
        if self.qkv_bias or self.o_bias or self.mlp_bias:
            rows["biases"] = ", ".join(n for n, on in (("q/k/v", self.qkv_bias), ("o", self.o_bias),
                                                      ("mlp", self.mlp_bias)) if on)
        if self.qk_norm:
            rows["qk_norm"] = "RMSNorm on q and k (per head)"
        if self.post_norms:
            rows["post_norms"] = "after attention and after MLP"
        if self.embed_scale is not None:
            rows["embed_scale"] = f"{self.embed_scale:.4f} (sqrt d_model)"
        if self.query_pre_attn_scalar is not None:
            rows["attn_scale"] = f"query_pre_attn_scalar {self.query_pre_attn_scalar:g} ** -0.5"
        if SLIDING in self.layer_types:
            n = self.layer_types.count(SLIDING)
            rows["sliding_window"] = f"{self.sliding_window} on {n} of {self.num_hidden_layers} layers"
        if self.final_logit_softcapping is not None:
            rows["logit_softcap"] = self.final_logit_softcapping
        rows["tied_lm_head"] = self.tie_word_embeddings
        return rows

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    # --- reading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Normalise a parsed ``config.json``. Absent fields take the default of the family's
        transformers config class (e.g. Gemma 3's ``query_pre_attn_scalar`` 256).

        Raises:
            ConfigError: unknown ``model_type`` (lists the supported families), a required field
                missing, shapes that cannot work (heads not dividing ``hidden_size`` when no
                ``head_dim`` is given, kv heads not dividing heads), or a variant minillm does not
                implement (a RoPE scaling type, an activation, bidirectional attention...).
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object of fields, got {type(raw).__name__}; "
                              "re-download config.json.")
        model_type = raw.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_FAMILIES:
            families = ", ".join(f"{k} ({v[0]})" for k, v in SUPPORTED_FAMILIES.items())
            hint = (" This is the multimodal Gemma 3 config; minillm runs the text-only model "
                    "(Gemma3ForCausalLM, model_type gemma3_text)." if model_type == "gemma3" else "")
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; minillm implements: "
                f"{families}.{hint} Use a model of one of these families."
            )
        family = SUPPORTED_FAMILIES[model_type][0]
        if family == "gpt2":  # GPT-2 spells the common fields its own way
            raw = {**raw, **{new: raw[old] for old, new in (
                ("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
                ("n_positions", "max_position_embeddings")) if old in raw}}

        def need(name: str) -> Any:
            if name not in raw or raw[name] is None:
                raise ConfigError(f"{source}: required field {name!r} is missing; add it to config.json.")
            return raw[name]

        def size(name: str, value: Any) -> int:
            # A size must be a whole number >= 1; 0 or "64" would fail later as ZeroDivisionError.
            whole = (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, float) and value.is_integer())
            if not whole or value < 1:
                raise ConfigError(f"{source}: {name} must be a positive integer, got {value!r}; fix config.json.")
            return int(value)

        hidden = size("hidden_size", need("hidden_size"))
        n_heads = size("num_attention_heads", need("num_attention_heads"))
        n_layers = size("num_hidden_layers", need("num_hidden_layers"))
        n_kv = size("num_key_value_heads", raw.get("num_key_value_heads") or n_heads)
        size("vocab_size", need("vocab_size"))
        for name in ("intermediate_size", "max_position_embeddings", "n_inner", "head_dim"):
            if raw.get(name) is not None:
                size(name, raw[name])
        head_dim = raw.get("head_dim") or {"qwen3": 128, "gemma3": 256}.get(family)
        if head_dim is None:
            if hidden % n_heads:
                raise ConfigError(
                    f"{source}: num_attention_heads={n_heads} does not divide hidden_size={hidden} "
                    "and no head_dim is given; fix the config or add head_dim."
                )
            head_dim = hidden // n_heads
        if n_heads % n_kv:
            raise ConfigError(
                f"{source}: num_key_value_heads={n_kv} does not divide num_attention_heads={n_heads}; "
                "grouped-query attention needs a whole number of query heads per kv head."
            )
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        common = dict(
            model_type=model_type,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=int(head_dim),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
        )
        flags = _FAMILY_FLAGS[family](raw, common, source)
        known = set(cls.__dataclass_fields__)
        return cls(**common, **flags, extra={k: v for k, v in raw.items() if k not in known})

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``<path>/config.json``.

        Raises:
            ConfigError: the file is missing or is not valid JSON (names the path), or see
                :meth:`from_dict`.
        """
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(
                f"no config.json in {Path(path)}; a model folder needs config.json, tokenizer.json "
                "and *.safetensors weights (download the full model or pass a model name)."
            )
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file} is not valid JSON ({exc}); re-download the model.") from exc
        return cls.from_dict(raw, source=str(file))


# --- per-family flags -----------------------------------------------------------------------------
def _activation(name: Any, source: str) -> str:
    if name not in _ACTIVATIONS:
        raise ConfigError(f"{source}: activation {name!r} is not implemented; minillm has "
                          f"{sorted(_ACTIVATIONS)}. Use a model with one of these.")
    return _ACTIVATIONS[name]


def _rope(params: Any, theta: Any, scaling: Any, default_theta: float, max_pos: int,
          source: str, what: str) -> tuple[float, dict | None]:
    """One RoPE setting -> (theta, scaling or None), from either dialect.

    ``params`` is a transformers-5 ``rope_parameters`` entry ({"rope_type", "rope_theta", ...});
    ``theta``/``scaling`` are the hub dialect's ``rope_theta``/``rope_scaling``.
    """
    params = dict(params or {})
    if scaling:
        params = {**dict(scaling), **params}
    theta = params.pop("rope_theta", theta)
    kind = params.pop("rope_type", params.pop("type", "default")) or "default"
    if kind not in _ROPE_TYPES:
        raise ConfigError(f"{source}: {what} RoPE scaling of type {kind!r} is not implemented (minillm has "
                          f"{', '.join(_ROPE_TYPES)}); use a model without it.")
    theta = float(theta if theta is not None else default_theta)
    if kind == "default":
        return theta, None
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}[kind]
    if missing := [k for k in need if k not in params]:
        raise ConfigError(f"{source}: {what} rope_scaling of type {kind!r} lacks {missing}; fix config.json.")
    out = {"rope_type": kind, **{k: float(params[k]) for k in need}}
    if kind == "llama3":
        out["original_max_position_embeddings"] = int(params.get("original_max_position_embeddings", max_pos))
    return theta, out


def _layer_types(raw: dict, n_layers: int, source: str) -> tuple[str, ...]:
    types = tuple(raw.get("layer_types") or ())
    if types and (len(types) != n_layers or set(types) - {FULL, SLIDING}):
        raise ConfigError(f"{source}: layer_types must list {n_layers} entries of {FULL!r} or {SLIDING!r}; "
                          f"got {list(types)[:4]}... ({len(types)} entries). Fix config.json.")
    return types


def _llama_flags(raw: dict, common: dict, source: str) -> dict:
    """Llama, and the common core of Qwen 2/3: RMSNorm, RoPE, SwiGLU (``models/llama``)."""
    max_pos = int(raw.get("max_position_embeddings", 2048))
    params = raw.get("rope_parameters")
    theta, scaling = _rope(params, raw.get("rope_theta"), raw.get("rope_scaling"), 10000.0, max_pos, source,
                           "the")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        intermediate_size=int(_need(raw, "intermediate_size", source)),
        max_position_embeddings=max_pos,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        qkv_bias=bias, o_bias=bias,  # LlamaAttention: attention_bias covers q, k, v and o
        hidden_act=_activation(raw.get("hidden_act", "silu"), source),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def _qwen_sliding(raw: dict, n_layers: int, source: str) -> dict:
    # Qwen 2/3 configs carry sliding_window even when use_sliding_window is false (then it is off).
    if not raw.get("use_sliding_window", False) or raw.get("sliding_window") is None:
        return {}
    types = _layer_types(raw, n_layers, source) or tuple(
        SLIDING if i >= int(raw.get("max_window_layers", 28)) else FULL for i in range(n_layers))
    return {"sliding_window": int(raw["sliding_window"]), "layer_types": types} if SLIDING in types else {}


def _qwen2_flags(raw: dict, common: dict, source: str) -> dict:
    """Qwen 2 (``models/qwen2``): Llama with biases on q, k, v (never on o)."""
    flags = _llama_flags(raw, common, source)
    flags.update(qkv_bias=True, o_bias=False, mlp_bias=False)
    return {**flags, **_qwen_sliding(raw, common["num_hidden_layers"], source)}


def _qwen3_flags(raw: dict, common: dict, source: str) -> dict:
    """Qwen 3 (``models/qwen3``): Llama plus q_norm/k_norm per head before RoPE."""
    flags = _llama_flags(raw, common, source)
    flags.update(qk_norm=True, mlp_bias=False)
    return {**flags, **_qwen_sliding(raw, common["num_hidden_layers"], source)}


def _gpt2_flags(raw: dict, common: dict, source: str) -> dict:
    """GPT-2 (``models/gpt2``): learned positions, LayerNorm, biases everywhere, GELU tanh MLP."""
    if raw.get("scale_attn_by_inverse_layer_idx"):
        raise ConfigError(f"{source}: scale_attn_by_inverse_layer_idx is not implemented; use a GPT-2 "
                          "model without it.")
    if raw.get("add_cross_attention"):
        raise ConfigError(f"{source}: add_cross_attention makes GPT-2 an encoder-decoder half; minillm "
                          "runs decoder-only models.")
    hidden = common["hidden_size"]
    return dict(
        intermediate_size=int(raw.get("n_inner") or 4 * hidden),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1024)),
        norm="layernorm", norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        position_embedding="learned",
        qkv_bias=True, o_bias=True, mlp="plain", mlp_bias=True,
        hidden_act=_activation(raw.get("activation_function", "gelu_new"), source),
        # GPT2Attention: scale by head_dim ** -0.5 unless scale_attn_weights is false (then 1.0)
        query_pre_attn_scalar=None if raw.get("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def _gemma3_flags(raw: dict, common: dict, source: str) -> dict:
    """Gemma 3 text (``models/gemma3``, ``Gemma3TextConfig`` defaults for absent fields)."""
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention (EmbeddingGemma) is not a causal LM; "
                          "minillm runs decoder-only generation models.")
    n_layers, hidden = common["num_hidden_layers"], common["hidden_size"]
    max_pos = int(raw.get("max_position_embeddings", 131072))
    types = _layer_types(raw, n_layers, source)
    if not types:  # older configs: every sliding_window_pattern-th layer is global (default 6)
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n_layers))
    params = raw.get("rope_parameters") or {}
    nested = FULL in params or SLIDING in params
    theta, scaling = _rope(params.get(FULL) if nested else params, raw.get("rope_theta"), raw.get("rope_scaling"),
                           1_000_000.0, max_pos, source, "full-attention")
    local_theta, local_scaling = _rope(params.get(SLIDING) if nested else None, raw.get("rope_local_base_freq"),
                                       None, 10_000.0, max_pos, source, "sliding-window")
    if local_scaling is not None:
        raise ConfigError(f"{source}: RoPE scaling on sliding-window layers is not implemented; "
                          "use a model without it.")
    window = raw.get("sliding_window", 4096)
    if window is None and SLIDING in types:
        raise ConfigError(f"{source}: layer_types has sliding layers but sliding_window is null; fix config.json.")
    cap = raw.get("final_logit_softcapping")
    # attn_logit_softcapping is read by nobody: Gemma3Attention never passes it to the attention
    # function (it was Gemma 2's), and Gemma 3 checkpoints set it to null. We ignore it too.
    return dict(
        intermediate_size=int(_need(raw, "intermediate_size", source)),
        max_position_embeddings=max_pos,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)), norm_weight_offset=1.0,
        qk_norm=True, post_norms=True,
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
        qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        sliding_window=None if SLIDING not in types else int(window),
        layer_types=types,
        hidden_act=_activation(raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh")), source),
        # Gemma3TextScaledWordEmbedding: x * sqrt(hidden_size), the scale cast to the activation dtype
        embed_scale=float(math.sqrt(hidden)),
        final_logit_softcapping=None if cap is None else float(cap),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def _need(raw: dict, name: str, source: str) -> Any:
    if raw.get(name) is None:
        raise ConfigError(f"{source}: required field {name!r} is missing; add it to config.json.")
    return raw[name]


_FAMILY_FLAGS = {"llama": _llama_flags, "gpt2": _gpt2_flags, "qwen2": _qwen2_flags, "qwen3": _qwen3_flags,
                 "gemma3": _gemma3_flags}
