"""A tiny real GGUF (one llama layer, d_model 8, a byte-level vocabulary of 258 tokens), written with
``gguf.GGUFWriter`` as llama.cpp's converter lays it out: for tests that need a file the converter and
the header reader accept, without the network."""

from __future__ import annotations

from pathlib import Path

import numpy as np

D_MODEL, N_HEADS, N_KV, HEAD_DIM, FFN = 8, 2, 1, 4, 16
VOCAB = 258  # an end-of-text token, 256 bytes, one merge
_NAMES = {  # GGUF name -> shape [out, in] (NumPy order)
    "token_embd.weight": (258, D_MODEL),
    "output_norm.weight": (D_MODEL,),
    "blk.0.attn_q.weight": (N_HEADS * HEAD_DIM, D_MODEL),
    "blk.0.attn_k.weight": (N_KV * HEAD_DIM, D_MODEL),
    "blk.0.attn_v.weight": (N_KV * HEAD_DIM, D_MODEL),
    "blk.0.attn_output.weight": (D_MODEL, N_HEADS * HEAD_DIM),
    "blk.0.ffn_gate.weight": (FFN, D_MODEL),
    "blk.0.ffn_up.weight": (FFN, D_MODEL),
    "blk.0.ffn_down.weight": (D_MODEL, FFN),
    "blk.0.attn_norm.weight": (D_MODEL,),
    "blk.0.ffn_norm.weight": (D_MODEL,),
}


def header_writer(path: Path, arch: str = "llama", big_endian: bool = False):
    """A ``gguf.GGUFWriter`` for ``path`` with the tiny model's header written in: a 1-layer ``arch``
    (``D_MODEL``, ``FFN``, ``N_HEADS``, ``N_KV``, context 64) and a byte-level BPE vocabulary of 258
    (an end-of-text token, 256 bytes, the merge ``h i``); the caller adds tensors and writes the file."""
    import gguf
    from tokenizers import pre_tokenizers

    endianess = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(D_MODEL)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    tokens = ["<|endoftext|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "hi"]
    assert len(tokens) == VOCAB
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    w.add_token_merges(["h i"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    return w


def write_tiny_gguf(path: Path) -> int:
    """Write the file; return its vocabulary size (:data:`VOCAB`)."""
    w = header_writer(path)
    rng = np.random.default_rng(0)
    for name, shape in _NAMES.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return VOCAB
