"""The GGUF families: how one ``general.architecture`` maps onto a Hugging Face config and tensor names.

One :class:`ArchSpec` a family (metadata keys, tensor names, the settings the GGUF leaves out, the
rows llama.cpp permuted for its RoPE, the norm shift), and the two steps both GGUF readers share:
:func:`plan_tensors` (each GGUF tensor's HF name, checked) and :func:`unpermute_rope_rows`.
Used by ``gguf_import.py`` (GGUF -> float32 folder) and ``gguf_packed.py`` (blocks kept packed).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minillm.errors import GGUFError

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


# --- tensors ------------------------------------------------------------------------------------
def plan_tensors(path, spec: ArchSpec, reader, config: dict) -> list[tuple[Any, str, str | None]]:
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


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
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
