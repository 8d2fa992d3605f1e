"""The tiny random transformers models of tests/model/test_families.py: one case per family and format,
built, saved and reloaded by :func:`build` (torch and transformers imported inside it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOCAB = 300
PROMPT = 24  # positions compared: 16 in prefill, then 8 decode steps
TOLERANCE = 1e-4


@dataclass
class Case:
    """A tiny model of one family, saved in one format."""

    config_class: str
    config: dict[str, Any]
    dtype: str = "float32"  # as saved: float32 | float16 | bfloat16
    shard: str | None = None  # save_pretrained(max_shard_size=...) for a sharded checkpoint
    add_tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)  # extra tensors written into the file
    add_lm_head: bool = False  # write the tied head into the file too (some exporters do)


CASES = {
    # Llama 3.1-style RoPE scaling (llama3); GQA 8/2; untied; bfloat16 file.
    "llama3": Case("LlamaConfig", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}), dtype="bfloat16"),
    # GPT-2: learned positions, LayerNorm, biases, fused Conv1D c_attn; tied head absent; float16 file.
    "gpt2": Case("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=None,
                                     tie_word_embeddings=True), dtype="float16"),
    # GPT-2 with its own head (untied), float32.
    "gpt2-untied": Case("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=96,
                                            tie_word_embeddings=False)),
    # Qwen 2: q/k/v biases, GQA 4/2, tied; sharded into several files.
    "qwen2": Case("Qwen2Config", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=True), shard="60KB"),
    # Qwen 3: QK-norm, head_dim 32 != 64 / 4; untied; float32 with a tensor the model does not use.
    "qwen3": Case("Qwen3Config", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=128, tie_word_embeddings=False),
        add_tensors={"model.layers.0.self_attn.rotary_emb.inv_freq": (16,)}),
    # Gemma 3: sliding window 8 (< the 24-token prompt) on 3 of 4 layers, local RoPE base, GeGLU,
    # QK-norm, pre/post norms, (1 + w) norms, query_pre_attn_scalar; tied with lm_head in the file; bf16.
    "gemma3": Case("Gemma3TextConfig", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=128, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]),
        dtype="bfloat16", add_lm_head=True),
    # Gemma 3 with the rarer switches: linear RoPE scaling on global layers, final soft-capping, the
    # older sliding_window_pattern spelling; float32. attn_logit_softcapping is set but, as in
    # transformers' Gemma3Attention, not used.
    "gemma3-softcap": Case("Gemma3TextConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=128, sliding_window=6, sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, final_logit_softcapping=3.0,
        attn_logit_softcapping=5.0)),
}


def build(case: Case, folder: Path, seed: int = 0, vocab: int = VOCAB):
    """Create, randomise and save the model; return (folder, the transformers model reloaded in float32)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    config = getattr(transformers, case.config_class)(vocab_size=vocab, initializer_range=0.1, **case.config)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None  # GPT-2's 50256 is off our vocab
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norm weights and biases start at 1 or 0; move them, or (1 + w) vs w goes untested
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    hf = hf.to(getattr(torch, case.dtype))
    kwargs = {"max_shard_size": case.shard} if case.shard else {}
    hf.save_pretrained(folder, **kwargs)
    if case.add_tensors or case.add_lm_head:
        file = folder / "model.safetensors"
        tensors = load_file(str(file))
        for name, shape in case.add_tensors.items():
            tensors[name] = torch.randn(shape).to(getattr(torch, case.dtype))
        if case.add_lm_head:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, str(file), metadata={"format": "pt"})
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return folder, ref.eval()
