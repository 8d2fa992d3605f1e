"""ModelConfig: a model's shape and family flags, normalised from Hugging Face ``config.json``.

Field names follow Hugging Face (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
``rope_theta``, ...) so a student can put the two files side by side. Family differences are
*flags* here (norm kind, position encoding, biases, QK-norm, MLP kind, sliding windows, ...), read
by the one forward pass in ``transformer.py``; they are never a second copy of it. ``families.py``
sets them from each family's ``config.json``.

Two dialects of config.json exist: hub checkpoints carry
``rope_theta`` / ``rope_scaling`` (Gemma 3 also ``rope_local_base_freq``); transformers 5 writes
``rope_parameters``, flat or, for Gemma 3, one entry per layer type (``full_attention``,
``sliding_attention``). Both are read. GPT-2 spells its sizes ``n_embd``, ``n_layer``, ``n_head``,
``n_positions``, ``n_inner``; those are read too.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from minillm.errors import ConfigError, InvalidRequestError
from minillm.model.families import (
    FAMILY_FLAGS,
    FULL,
    SUPPORTED_FAMILIES,
    LayerType,
    MlpKind,
    NormKind,
    PositionKind,
    need,
)
from minillm.sources.json_file import read_json

#: The dtypes a KV cache can hold its entries in, each under NumPy's name for it -> (bytes one value
#: takes, bytes stored beside each position's values per head: int8's float32 scale). ``kv_cache.py``
#: stores them; every KV size (:meth:`ModelConfig.kv_bytes_per_token`, the memory plan, ``minillm
#: describe``'s table) is read from this one table.
KV_DTYPES = {"float32": (4, 0), "float16": (2, 0), "int8": (1, 4)}


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
    norm: NormKind = NormKind.RMSNORM  # LayerNorm with bias: GPT-2
    norm_eps: float = 1e-6  # HF rms_norm_eps (GPT-2: layer_norm_epsilon)
    norm_weight_offset: float = 0.0  # Gemma stores w and multiplies by (1 + w): offset 1.0
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen 3, Gemma 3)
    post_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 3)
    # --- positions ---
    position_embedding: PositionKind = PositionKind.ROPE  # learned: GPT-2's wpe table
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}; None = plain
    rope_local_theta: float | None = None  # RoPE base of sliding-window layers (Gemma 3); None = rope_theta
    # --- attention ---
    qkv_bias: bool = False
    o_bias: bool = False
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5, not head_dim ** -0.5
    sliding_window: int | None = None  # keys a sliding-window layer sees (itself included)
    layer_types: tuple[LayerType, ...] = ()  # per layer FULL or SLIDING; () = all FULL
    # --- MLP, embeddings, head ---
    mlp: MlpKind = MlpKind.GATED  # SwiGLU / GeGLU; plain: GPT-2 (up, act, down)
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
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """What ``q . k`` is multiplied by: ``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_type(self, i: int) -> LayerType:
        """``LayerType.FULL`` or ``LayerType.SLIDING`` for layer ``i``."""
        return self.layer_types[i] if self.layer_types else FULL

    def kv_bytes_per_token(self, kv_dtype: str = "float32") -> int:
        """Bytes one position costs in a KV cache of this model held at ``kv_dtype`` (:data:`KV_DTYPES`):
        ``2 (k and v) * layers * kv_heads * (head_dim * bytes per value + scale bytes)``; int8 stores one
        float32 scale per position and head beside its values.

        Grouped-query attention (few kv heads) is what keeps it small: SmolLM2 stores 3 kv heads for
        its 9 query heads.

        Raises:
            InvalidRequestError: ``kv_dtype`` is not in :data:`KV_DTYPES` (the message names the choices).
        """
        if kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}.")
        value_bytes, scale_bytes = KV_DTYPES[kv_dtype]
        return 2 * self.num_hidden_layers * self.num_key_value_heads * (self.head_dim * value_bytes + scale_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    # --- reading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Normalise a parsed ``config.json``. Absent fields take the default of the family's
        transformers config class (e.g. Gemma 3's ``query_pre_attn_scalar`` 256).

        Raises:
            ConfigError: unknown ``model_type`` (lists the supported families), a required field
                missing, shapes that cannot work (heads not dividing ``hidden_size`` when no
                ``head_dim`` is given, kv heads not dividing heads), or a variant minillm does not
                implement (a RoPE scaling type, an activation, bidirectional attention...).
        """
        model_type, family = _family(raw, source)
        if family == "gpt2":  # GPT-2 spells the common fields its own way
            raw = {**raw, **{new: raw[old] for old, new in GPT2_NAMES if old in raw}}
        hidden, n_heads, n_layers, n_kv, head_dim = _shapes(raw, family, source)
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        common = dict(
            model_type=model_type,
            family=family,
            vocab_size=int(need(raw, "vocab_size", source)),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=int(head_dim),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
        )
        flags = FAMILY_FLAGS[family](raw, common, source)
        known = set(cls.__dataclass_fields__)
        return cls(**common, **flags, extra={k: v for k, v in raw.items() if k not in known})

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> ModelConfig:
        """Read ``<path>/config.json``.

        Raises:
            ConfigError: the file is missing or is not valid JSON (names the path), or see
                :meth:`from_dict`.
        """
        file = Path(path) / "config.json"
        missing = (
            f"no config.json in {Path(path)}; a model folder needs config.json, tokenizer.json "
            "and *.safetensors weights (download the full model or pass a model name)."
        )
        raw = read_json(file, ConfigError, missing=missing, fix="re-download the model.")
        return cls.from_dict(raw, source=str(file))


#: GPT-2's names of the common fields -> the names the other families use.
GPT2_NAMES = (
    ("n_embd", "hidden_size"),
    ("n_layer", "num_hidden_layers"),
    ("n_head", "num_attention_heads"),
    ("n_positions", "max_position_embeddings"),
)


def _family(raw: Any, source: str) -> tuple[str, str]:
    """``(model_type, family)`` of a parsed config.json. Raises ConfigError: not a JSON object, or
    a ``model_type`` minillm does not implement (naming the supported ones)."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a JSON object of fields, got {type(raw).__name__}; re-download config.json."
        )
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_FAMILIES:
        families = ", ".join(f"{k} ({v[0]})" for k, v in SUPPORTED_FAMILIES.items())
        hint = (
            " This is the multimodal Gemma 3 config; minillm runs the text-only model "
            "(Gemma3ForCausalLM, model_type gemma3_text)."
            if model_type == "gemma3"
            else ""
        )
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported; minillm implements: "
            f"{families}.{hint} Use a model of one of these families."
        )
    return model_type, SUPPORTED_FAMILIES[model_type][0]


def _size(name: str, value: Any, source: str) -> int:
    """A size must be a whole number >= 1 (0 or "64" would fail later as ZeroDivisionError). Raises ConfigError."""
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )
    if not whole or value < 1:
        raise ConfigError(f"{source}: {name} must be a positive integer, got {value!r}; fix config.json.")
    return int(value)


def _shapes(raw: dict, family: str, source: str) -> tuple[int, int, int, int, int]:
    """``(hidden_size, heads, layers, kv_heads, head_dim)``, every size checked. Raises ConfigError:
    a required size missing or not a positive integer, heads not dividing ``hidden_size`` when no
    ``head_dim`` is given, kv heads not dividing heads."""
    hidden = _size("hidden_size", need(raw, "hidden_size", source), source)
    n_heads = _size("num_attention_heads", need(raw, "num_attention_heads", source), source)
    n_layers = _size("num_hidden_layers", need(raw, "num_hidden_layers", source), source)
    n_kv = _size("num_key_value_heads", raw.get("num_key_value_heads") or n_heads, source)
    _size("vocab_size", need(raw, "vocab_size", source), source)
    for name in ("intermediate_size", "max_position_embeddings", "n_inner", "head_dim"):
        if raw.get(name) is not None:
            _size(name, raw[name], source)
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
    return hidden, n_heads, n_layers, n_kv, int(head_dim)
