"""ModelConfig: a model's shape and family flags, normalised from Hugging Face ``config.json``.

Field names follow Hugging Face (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
``rope_theta``, ...) so a student can put the two files side by side. Family differences are
*flags* here, read by the one forward pass in ``model.py``; they are never a second copy of it.

Two dialects of config.json exist (see DESIGN.md, "Known traps"): hub checkpoints carry
``rope_theta`` / ``rope_scaling``; transformers 5 writes ``rope_parameters``. Both are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

#: model_type values this runtime implements, with what sets each family apart.
SUPPORTED_FAMILIES = {
    "llama": "RMSNorm, RoPE (half-split), GQA, SwiGLU MLP, tied or untied LM head",
}


@dataclass(frozen=True)
class ModelConfig:
    """The numbers that fix a model's shapes, plus the flags that pick its family's variant.

    Shapes that follow: embeddings ``[vocab_size, hidden_size]``; per layer q ``[num_attention_heads
    * head_dim]``, k and v ``[num_key_value_heads * head_dim]``; MLP ``[hidden_size,
    intermediate_size]``. ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
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
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
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

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """KV-cache bytes one position costs: ``2 (k and v) * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element

    def summary(self) -> dict[str, Any]:
        """The fields a trace shows at startup (family, layers, d_model, heads, context, RoPE)."""
        return {
            "family": self.model_type,
            "layers": self.num_hidden_layers,
            "d_model": self.hidden_size,
            "heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "ffn": self.intermediate_size,
            "vocab": self.vocab_size,
            "context": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "tied_lm_head": self.tie_word_embeddings,
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    # --- reading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Normalise a parsed ``config.json``.

        Raises:
            ConfigError: unknown ``model_type`` (lists the supported families), a required field
                missing, or shapes that cannot work (heads not dividing ``hidden_size`` when no
                ``head_dim`` is given, kv heads not dividing heads).
        """
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            families = ", ".join(sorted(SUPPORTED_FAMILIES))
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; minillm implements: "
                f"{families}. Use a model of one of these families."
            )

        def need(name: str) -> Any:
            if name not in raw or raw[name] is None:
                raise ConfigError(f"{source}: required field {name!r} is missing; add it to config.json.")
            return raw[name]

        hidden = int(need("hidden_size"))
        n_heads = int(need("num_attention_heads"))
        n_kv = int(raw.get("num_key_value_heads") or n_heads)
        head_dim = raw.get("head_dim")
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

        # Two dialects: rope_theta/rope_scaling (hub) or rope_parameters (transformers 5).
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling")
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict):
            if "rope_theta" in rope_params or "rope_type" in rope_params:
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = dict(rope_params)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
            None,
            "default",
        ):
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            raise ConfigError(
                f"{source}: rope_scaling of type {kind!r} is not implemented yet; "
                "use a model without RoPE scaling."
            )

        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            hidden_act=str(raw.get("hidden_act", "silu")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
            extra={k: v for k, v in raw.items() if k not in known},
        )

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
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file} is not valid JSON ({exc}); re-download the model.") from exc
        return cls.from_dict(raw, source=str(file))
