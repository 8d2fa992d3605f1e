"""A tiny, real Llama folder's parts (config and seeded NumPy tensors, saved as safetensors), shared
by the error tests and the mmap tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

D, FFN, HEADS, KV_HEADS, LAYERS, CONTEXT = 8, 16, 2, 1, 1, 32


# --- a tiny, real model folder ---------------------------------------------------------------------
def tiny_config(vocab: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": D,
            "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "max_position_embeddings": CONTEXT, "tie_word_embeddings": True}


def tiny_tensors(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    hd = D // HEADS
    shapes = {"model.embed_tokens.weight": (vocab, D), "model.norm.weight": (D,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_proj.weight": (HEADS * hd, D), p + "self_attn.k_proj.weight": (KV_HEADS * hd, D),
                   p + "self_attn.v_proj.weight": (KV_HEADS * hd, D), p + "self_attn.o_proj.weight": (D, HEADS * hd),
                   p + "mlp.gate_proj.weight": (FFN, D), p + "mlp.up_proj.weight": (FFN, D),
                   p + "mlp.down_proj.weight": (D, FFN)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def save(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})



def tiny_model(folder: Path, vocab: int, tensors: dict[str, np.ndarray] | None = None, name: str = "tiny"):
    """A loaded minillm Model in ``folder``, which already holds a tokenizer of ``vocab`` ids: the
    tiny Llama above (``tensors``, default the seeded ones), context 32. NumPy only, milliseconds."""
    import json

    from minillm.model.config import ModelConfig
    from minillm.model.transformer import Transformer
    from minillm.model.weights import load_weights
    from minillm.runtime.loading import Model
    from minillm.text.tokenizer import Tokenizer

    (folder / "config.json").write_text(json.dumps(tiny_config(vocab)))
    save(tiny_tensors(vocab) if tensors is None else tensors, folder / "model.safetensors")
    config = ModelConfig.from_folder(folder)
    transformer = Transformer(config, load_weights(folder, config))
    return Model(name, folder, config, Tokenizer.from_folder(folder), transformer, None)


def tiny_word_model(folder: Path, tensors: dict[str, np.ndarray] | None = None, name: str = "tiny"):
    """:func:`tiny_model` over the scripted whole-word vocabulary (``scripted.word_tokenizer_folder``:
    108 ids, EOS 1 and 106)."""
    from scripted import word_tokenizer_folder

    word_tokenizer_folder(folder)
    return tiny_model(folder, 108, tensors, name)
