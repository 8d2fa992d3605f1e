"""Families: what sets each model family apart, in one place.

Every family runs through the same forward pass (``transformer.py``). What differs is data:

- **flags** in :class:`~minillm.model.config.ModelConfig`, set here from ``config.json`` by one
  function per family (``_llama_flags``, ``_gpt2_flags``, ...): the norm kind, the position
  encoding, biases, QK-norm, post-norms, the MLP kind, sliding-window layers, ...
- **tensor names**: :data:`NAME_MAPS` maps each family's Hugging Face tensor names onto minillm's
  one weight layout (``weights.py``).

What sets each family apart, and where transformers says so (``models/<family>/modeling_*.py`` and
``configuration_*.py``), is in :data:`SUPPORTED_FAMILIES`.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from minillm.errors import ConfigError


class NormKind(enum.StrEnum):
    """Which normalisation every norm of the model is (Zhang & Sennrich 2019; Ba et al. 2016)."""

    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"  # GPT-2: subtract the mean, add a bias


class PositionKind(enum.StrEnum):
    """How the model knows where a token is."""

    ROPE = "rope"  # rotate q and k by the position (Su et al. 2021)
    LEARNED = "learned"  # GPT-2: add a learned vector per absolute position


class MlpKind(enum.StrEnum):
    """The MLP's shape (Shazeer 2020 for the gated ones)."""

    GATED = "gated"  # down(act(gate(x)) * up(x)): SwiGLU, GeGLU
    PLAIN = "plain"  # GPT-2: down(act(up(x)))


class LayerType(enum.StrEnum):
    """Which keys a layer's attention may read; the values are transformers' ``layer_types`` names."""

    FULL = "full_attention"  # every earlier position
    SLIDING = "sliding_attention"  # only the last ``sliding_window`` positions


FULL, SLIDING = LayerType.FULL, LayerType.SLIDING

#: config.json "model_type" -> (minillm family, what sets it apart).
SUPPORTED_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "RMSNorm, RoPE (half-split, optional llama3 scaling), GQA, SwiGLU MLP"),
    "gpt2": ("gpt2", "learned positions, LayerNorm with bias, biased fused attention and MLP, GELU (tanh)"),
    "qwen2": ("qwen2", "Llama plus biases on q, k and v"),
    "qwen3": ("qwen3", "Llama plus per-head RMSNorm on q and k before RoPE, head_dim from the config"),
    "gemma3_text": (
        "gemma3",
        "RMSNorm (1 + w), scaled embeddings, QK-norm, pre/post norms, GeGLU, "
        "sliding-window layers with their own RoPE base",
    ),
}

_ROPE_TYPES = ("default", "linear", "llama3")  # implemented in primitives.rope_inverse_frequencies
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}  # HF name -> primitives.ACTIVATIONS key


# --- Hugging Face names per family ----------------------------------------------------------------
# Internal key -> HF tensor name; "{i}" is the layer index. A key a family lacks is simply absent;
# which present keys are *required* follows from the config (biases, QK-norm, post-norms...).
_DECODER = {  # the "model.layers.{i}" layout of Llama, Qwen 2/3 and Gemma 3 (HF nn.Linear: [out, in])
    "embed_tokens": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    **{p: f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkvo"},
    **{f"{p}_bias": f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkvo"},
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    **{p: f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    **{f"{p}_bias": f"model.layers.{{i}}.mlp.{p}_proj.bias" for p in ("gate", "up", "down")},
}
# Gemma 3 puts a norm on each side of attention and of the MLP. Beware the names: its
# "post_attention_layernorm" normalises the attention *output*; Llama's (same name) is the pre-MLP norm.
_GEMMA3 = {
    **_DECODER,
    "attn_post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "mlp_post_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# GPT-2 (Conv1D weights stored [in, out]; c_attn holds q|k|v). Hub files written before
# GPT2LMHeadModel drop the "transformer." prefix; both spellings are accepted.
_GPT2 = {
    "embed_tokens": "transformer.wte.weight",
    "pos_embed": "transformer.wpe.weight",
    "final_norm": "transformer.ln_f.weight",
    "final_norm_bias": "transformer.ln_f.bias",
    "lm_head": "lm_head.weight",
    "attn_norm": "transformer.h.{i}.ln_1.weight",
    "attn_norm_bias": "transformer.h.{i}.ln_1.bias",
    "qkv": "transformer.h.{i}.attn.c_attn.weight",
    "qkv_bias": "transformer.h.{i}.attn.c_attn.bias",
    "o": "transformer.h.{i}.attn.c_proj.weight",
    "o_bias": "transformer.h.{i}.attn.c_proj.bias",
    "mlp_norm": "transformer.h.{i}.ln_2.weight",
    "mlp_norm_bias": "transformer.h.{i}.ln_2.bias",
    "up": "transformer.h.{i}.mlp.c_fc.weight",
    "up_bias": "transformer.h.{i}.mlp.c_fc.bias",
    "down": "transformer.h.{i}.mlp.c_proj.weight",
    "down_bias": "transformer.h.{i}.mlp.c_proj.bias",
}
NAME_MAPS = {"llama": _DECODER, "qwen2": _DECODER, "qwen3": _DECODER, "gemma3": _GEMMA3, "gpt2": _GPT2}
CONV1D_FAMILIES = {"gpt2"}  # linear weights stored [in, out] (transformers' pytorch_utils.Conv1D)
OPTIONAL_PREFIX = {"gpt2": "transformer."}


# --- per-family flags -----------------------------------------------------------------------------
def _activation(name: Any, source: str) -> str:
    if name not in _ACTIVATIONS:
        raise ConfigError(
            f"{source}: activation {name!r} is not implemented; minillm has "
            f"{sorted(_ACTIVATIONS)}. Use a model with one of these."
        )
    return _ACTIVATIONS[name]


def _rope(
    params: Any, theta: Any, scaling: Any, default_theta: float, max_pos: int, source: str, what: str
) -> tuple[float, dict | None]:
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
        raise ConfigError(
            f"{source}: {what} RoPE scaling of type {kind!r} is not implemented (minillm has "
            f"{', '.join(_ROPE_TYPES)}); use a model without it."
        )
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
        raise ConfigError(
            f"{source}: layer_types must list {n_layers} entries of {FULL!r} or {SLIDING!r}; "
            f"got {list(types)[:4]}... ({len(types)} entries). Fix config.json."
        )
    return tuple(LayerType(t) for t in types)


def _llama_flags(raw: dict, common: dict, source: str) -> dict:
    """Llama, and the common core of Qwen 2/3: RMSNorm, RoPE, SwiGLU (``models/llama``)."""
    max_pos = int(raw.get("max_position_embeddings", 2048))
    params = raw.get("rope_parameters")
    theta, scaling = _rope(params, raw.get("rope_theta"), raw.get("rope_scaling"), 10000.0, max_pos, source, "the")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        intermediate_size=int(need(raw, "intermediate_size", source)),
        max_position_embeddings=max_pos,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=bias,
        o_bias=bias,  # LlamaAttention: attention_bias covers q, k, v and o
        hidden_act=_activation(raw.get("hidden_act", "silu"), source),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def _qwen_sliding(raw: dict, n_layers: int, source: str) -> dict:
    # Qwen 2/3 configs carry sliding_window even when use_sliding_window is false (then it is off).
    if not raw.get("use_sliding_window", False) or raw.get("sliding_window") is None:
        return {}
    types = _layer_types(raw, n_layers, source) or tuple(
        SLIDING if i >= int(raw.get("max_window_layers", 28)) else FULL for i in range(n_layers)
    )
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
        raise ConfigError(
            f"{source}: scale_attn_by_inverse_layer_idx is not implemented; use a GPT-2 model without it."
        )
    if raw.get("add_cross_attention"):
        raise ConfigError(
            f"{source}: add_cross_attention makes GPT-2 an encoder-decoder half; minillm runs decoder-only models."
        )
    hidden = common["hidden_size"]
    return dict(
        intermediate_size=int(raw.get("n_inner") or 4 * hidden),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1024)),
        norm=NormKind.LAYERNORM,
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        position_embedding=PositionKind.LEARNED,
        qkv_bias=True,
        o_bias=True,
        mlp=MlpKind.PLAIN,
        mlp_bias=True,
        hidden_act=_activation(raw.get("activation_function", "gelu_new"), source),
        # GPT2Attention: scale by head_dim ** -0.5 unless scale_attn_weights is false (then 1.0)
        query_pre_attn_scalar=None if raw.get("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def _gemma3_flags(raw: dict, common: dict, source: str) -> dict:
    """Gemma 3 text (``models/gemma3``, ``Gemma3TextConfig`` defaults for absent fields)."""
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(
            f"{source}: use_bidirectional_attention (EmbeddingGemma) is not a causal LM; "
            "minillm runs decoder-only generation models."
        )
    n_layers, hidden = common["num_hidden_layers"], common["hidden_size"]
    max_pos = int(raw.get("max_position_embeddings", 131072))
    types = _layer_types(raw, n_layers, source)
    if not types:  # older configs: every sliding_window_pattern-th layer is global (default 6)
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n_layers))
    params = raw.get("rope_parameters") or {}
    nested = FULL in params or SLIDING in params
    theta, scaling = _rope(
        params.get(FULL) if nested else params,
        raw.get("rope_theta"),
        raw.get("rope_scaling"),
        1_000_000.0,
        max_pos,
        source,
        "full-attention",
    )
    local_theta, local_scaling = _rope(
        params.get(SLIDING) if nested else None,
        raw.get("rope_local_base_freq"),
        None,
        10_000.0,
        max_pos,
        source,
        "sliding-window",
    )
    if local_scaling is not None:
        raise ConfigError(
            f"{source}: RoPE scaling on sliding-window layers is not implemented; use a model without it."
        )
    window = raw.get("sliding_window", 4096)
    if window is None and SLIDING in types:
        raise ConfigError(f"{source}: layer_types has sliding layers but sliding_window is null; fix config.json.")
    cap = raw.get("final_logit_softcapping")
    # attn_logit_softcapping is read by nobody: Gemma3Attention never passes it to the attention
    # function (it was Gemma 2's), and Gemma 3 checkpoints set it to null. We ignore it too.
    return dict(
        intermediate_size=int(need(raw, "intermediate_size", source)),
        max_position_embeddings=max_pos,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        norm_weight_offset=1.0,
        qk_norm=True,
        post_norms=True,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        sliding_window=None if SLIDING not in types else int(window),
        layer_types=types,
        hidden_act=_activation(raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh")), source),
        # Gemma3TextScaledWordEmbedding: x * sqrt(hidden_size), the scale cast to the activation dtype
        embed_scale=float(math.sqrt(hidden)),
        final_logit_softcapping=None if cap is None else float(cap),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def need(raw: dict, name: str, source: str) -> Any:
    """``raw[name]``, or a ConfigError naming the missing field."""
    if raw.get(name) is None:
        raise ConfigError(f"{source}: required field {name!r} is missing; add it to config.json.")
    return raw[name]


#: family -> the function that reads its flags from config.json
FAMILY_FLAGS = {
    "llama": _llama_flags,
    "gpt2": _gpt2_flags,
    "qwen2": _qwen2_flags,
    "qwen3": _qwen3_flags,
    "gemma3": _gemma3_flags,
}
