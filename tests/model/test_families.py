"""One forward pass, five families: tiny random transformers models against minillm.

Each case builds a seeded, randomly initialised Hugging Face model (2-4 layers, small dims, GQA
where the family has it, a 300-token vocabulary), saves it with ``save_pretrained`` in one of the
formats a user hands us, and demands that minillm's prefill (16 positions) plus 8 cached decode
steps give the logits of transformers' full forward within 1e-4. Between them the cases cover
float32, float16 and bfloat16 files, a sharded checkpoint, tied heads with and without
``lm_head.weight`` in the file, untied heads, and extra tensors the model does not need.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minillm.model import primitives
from minillm.model.config import ModelConfig
from minillm.errors import ConfigError, WeightsError
from minillm.model.kv_cache import KVCache
from minillm.model.transformer import Transformer
from minillm.model.weights import load_weights
from minillm.observe.describe import config_rows, mask_picture
from minillm.sources.safetensors_file import read_safetensors_header

from tiny_families import CASES, PROMPT, TOLERANCE, VOCAB, Case, build  # noqa: F401  (shared with other tests)

def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor(ids[None])).logits[0].numpy()


def minillm_logits(folder: Path, ids: np.ndarray) -> tuple[np.ndarray, Transformer]:
    """Prefill 16 positions, then 8 single-token decode steps through the KV cache: ``[24, vocab]``."""
    config = ModelConfig.from_folder(folder)
    model = Transformer(config, load_weights(folder, config))
    cache = KVCache.for_model(config, max_seq_len=32)
    out = [model.forward(ids[:16], cache)]
    for t in range(16, len(ids)):
        out.append(model.forward(ids[t : t + 1], cache))
    assert cache.length == len(ids)
    return np.concatenate(out), model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each case built once per module run: name -> (folder, transformers model)."""
    made: dict[str, tuple[Path, Any]] = {}

    def get(name: str):
        if name not in made:
            made[name] = build(CASES[name], tmp_path_factory.mktemp(name))
        return made[name]

    return get




@pytest.mark.reference
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_and_decode_match_transformers(name, built):
    folder, hf = built(name)
    ids = np.random.default_rng(1).integers(0, VOCAB, size=PROMPT)
    want = hf_logits(hf, ids)  # [24, vocab], one full forward
    got, model = minillm_logits(folder, ids)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert want.std() > 0.3, "logits too flat to make the comparison mean anything"
    diff = float(np.abs(got - want).max())
    print(f"{name}: max abs logit difference {diff:.2e}")
    assert diff < TOLERANCE
    assert model.config.family == {"gpt2-untied": "gpt2", "gemma3-softcap": "gemma3", "llama3": "llama"}.get(name, name)


@pytest.mark.reference
def test_formats_are_the_ones_claimed(built):
    """What each case puts on disk: dtypes, shards, the tied head, extra tensors (so coverage is real)."""
    def stored(name):
        folder, _ = built(name)
        cfg = ModelConfig.from_folder(folder)
        return folder, cfg, load_weights(folder, cfg)

    folder, cfg, w = stored("llama3")
    assert set(w.stored_dtypes) == {"bfloat16"} and not cfg.tie_word_embeddings
    folder, cfg, w = stored("gpt2")
    assert set(w.stored_dtypes) == {"float16"} and cfg.tie_word_embeddings
    assert not any("lm_head" in n for f in w.files for n in read_safetensors_header(f))
    assert w.lm_head is w.embed_tokens  # tied: the very matrix, not a copy
    folder, cfg, w = stored("qwen2")
    assert len(w.files) >= 3 and (folder / "model.safetensors.index.json").is_file()
    folder, cfg, w = stored("qwen3")
    assert set(w.stored_dtypes) == {"float32"}
    assert w.unused_tensors == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    folder, cfg, w = stored("gemma3")
    assert "lm_head.weight" in read_safetensors_header(folder / "model.safetensors")
    assert w.unused_tensors == [] and w.lm_head is w.embed_tokens


@pytest.mark.reference
def test_llama3_rope_scaling_changes_the_logits(built, tmp_path):
    """The llama3 scaling must move the angles: the same weights without it give other logits,
    and transformers agrees with minillm both ways."""
    import torch
    import transformers

    folder, hf = built("llama3")
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(cfg))
    hf_plain = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    ids = np.random.default_rng(2).integers(0, VOCAB, size=PROMPT)
    scaled, _ = minillm_logits(folder, ids)
    unscaled, _ = minillm_logits(plain, ids)
    assert np.abs(scaled - unscaled).max() > 1e-2  # the scaling is not ignored
    assert np.abs(unscaled - hf_logits(hf_plain, ids)).max() < TOLERANCE
    assert np.abs(scaled - hf_logits(hf, ids)).max() < TOLERANCE
    for model, hf_model in ((folder, hf), (plain, hf_plain)):
        inv = primitives.rope_inverse_frequencies(8, 500000.0, ModelConfig.from_folder(model).rope_scaling)
        np.testing.assert_allclose(inv, hf_model.model.rotary_emb.inv_freq.numpy(), rtol=2e-7, atol=0)


@pytest.mark.reference
def test_hub_dialect_config_reads_the_same(built, tmp_path):
    """A hub-style config.json (rope_theta + rope_scaling, Gemma's rope_local_base_freq and
    sliding_window_pattern) gives the same ModelConfig as transformers 5's rope_parameters."""
    folder, _ = built("gemma3")
    new = ModelConfig.from_folder(folder)
    raw = json.loads((folder / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope["full_attention"]["rope_theta"]
    raw["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    assert ModelConfig.from_dict(raw) == new
    folder, _ = built("llama3")
    raw = json.loads((folder / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    assert ModelConfig.from_dict(raw) == ModelConfig.from_folder(folder)


def test_config_summary_shows_what_sets_a_family_apart():
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    gemma = config_rows(ModelConfig.from_dict({**base, "model_type": "gemma3_text", "sliding_window": 8}))
    assert gemma["family"] == "gemma3 (gemma3_text)"
    assert gemma["norm"] == "RMSNorm x (1 + w), eps 1e-06" and gemma["mlp"] == "GeGLU"
    assert gemma["sliding_window"] == "8 on 5 of 6 layers" and gemma["rope_local_theta"].startswith("10000")
    assert {"qk_norm", "post_norms", "embed_scale", "attn_scale"} <= gemma.keys()
    llama = config_rows(ModelConfig.from_dict({**base, "model_type": "llama", "head_dim": 16}))
    assert llama["mlp"] == "SwiGLU" and llama["positions"] == "RoPE theta 10000"
    assert not {"qk_norm", "post_norms", "embed_scale", "sliding_window", "biases"} & llama.keys()
    gpt2 = config_rows(ModelConfig.from_dict({"model_type": "gpt2", "vocab_size": 300, "n_embd": 64, "n_layer": 2,
                                  "n_head": 4}))
    assert gpt2["positions"] == "learned table [1024, 64]" and gpt2["norm"].startswith("LayerNorm")
    assert gpt2["biases"] == "q/k/v, o, mlp" and gpt2["mlp"] == "up, GELU tanh, down" and gpt2["ffn"] == 256
    qwen2 = config_rows(ModelConfig.from_dict({**base, "model_type": "qwen2", "use_sliding_window": False,
                                   "sliding_window": 4096}))
    assert qwen2["biases"] == "q/k/v" and "sliding_window" not in qwen2


def test_unsupported_variants_are_config_errors():
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4)
    with pytest.raises(ConfigError, match="'yarn' is not implemented"):
        ModelConfig.from_dict({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="lacks"):
        ModelConfig.from_dict({**base, "model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8}})
    with pytest.raises(ConfigError, match="activation 'relu' is not implemented"):
        ModelConfig.from_dict({**base, "model_type": "llama", "hidden_act": "relu"})
    with pytest.raises(ConfigError, match="text-only model"):
        ModelConfig.from_dict({**base, "model_type": "gemma3"})
    with pytest.raises(ConfigError, match="layer_types must list 2 entries"):
        ModelConfig.from_dict({**base, "model_type": "gemma3_text", "layer_types": ["full_attention"]})


# --- the sliding-window mask ------------------------------------------------------------------------
def test_sliding_window_mask_is_its_picture():
    mask = primitives.sliding_window_mask(6, 6, offset=0, window=3)
    doc = primitives.sliding_window_mask.__doc__
    rows = [line.strip() for line in doc.splitlines() if line.strip().startswith(("0 ", "- "))]
    prefill = [r[:11] for r in rows]  # the left picture: 6 rows of "x x x x x x"
    assert mask_picture(mask).splitlines() == prefill
    step = primitives.sliding_window_mask(1, 7, offset=6, window=3)  # decode at position 6 sees 4, 5, 6
    assert mask_picture(step) == rows[0][11:].strip()
    assert mask.dtype == np.float32 and np.isneginf(mask[3, 0]) and mask[3, 1] == 0


@pytest.mark.parametrize("seq, offset, window", [(5, 0, 3), (1, 9, 4), (4, 6, 2), (8, 0, 100), (3, 2, 1)])
def test_sliding_window_is_causal_and_at_most_window_back(seq, offset, window):
    mask = primitives.sliding_window_mask(seq, offset + seq, offset=offset, window=window)
    causal = primitives.causal_mask(seq, offset + seq, offset=offset)
    visible = mask == 0
    assert not (visible & np.isneginf(causal)).any()  # never sees the future
    assert (visible.sum(axis=1) == np.minimum(offset + np.arange(seq) + 1, window)).all()
    if window >= offset + seq:
        np.testing.assert_array_equal(mask, causal)  # a window longer than the text is plain causal


# --- weight files: bfloat16, errors ------------------------------------------------------------------
def test_bfloat16_widening_is_exact(tmp_path):
    import torch
    from safetensors.torch import save_file

    values = torch.randn(1000) * torch.logspace(-30, 30, 1000)
    values[:4] = torch.tensor([0.0, -0.0, float("inf"), 1e-40])  # zeros, inf, a subnormal
    save_file({"x": values.to(torch.bfloat16)}, str(tmp_path / "w.safetensors"))
    got = read_safetensors_header(tmp_path / "w.safetensors")["x"].to_float32()
    want = values.to(torch.bfloat16).to(torch.float32).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit


@pytest.mark.reference
def test_missing_and_misshapen_tensors_are_weights_errors(built, tmp_path):
    from safetensors.torch import load_file, save_file

    for name, victim in [("gemma3", "model.layers.2.post_feedforward_layernorm.weight"),
                         ("gpt2", "transformer.h.1.attn.c_attn.bias")]:
        folder, _ = built(name)
        broken = tmp_path / name
        shutil.copytree(folder, broken)
        tensors = load_file(str(broken / "model.safetensors"))
        del tensors[victim]
        save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
        cfg = ModelConfig.from_folder(broken)
        with pytest.raises(WeightsError, match=f"'{victim}' is missing"):
            load_weights(broken, cfg)
    folder, _ = built("qwen3")
    raw = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_dict({**raw, "intermediate_size": 100})
    with pytest.raises(WeightsError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(128, 64\), "
                                           r"expected \(100, 64\)"):
        load_weights(folder, cfg)


def test_corrupt_or_unreadable_files_are_weights_errors(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.ones(4, 4), "ids": torch.arange(3)}, str(tmp_path / "w.safetensors"))
    tensors = read_safetensors_header(tmp_path / "w.safetensors")
    np.testing.assert_array_equal(tensors["a"].to_float32(), np.ones((4, 4), np.float32))
    with pytest.raises(WeightsError, match="I64"):  # an integer tensor maps fine, but is not weights
        tensors["ids"].to_float32()
    data = (tmp_path / "w.safetensors").read_bytes()
    for cut in (4, 20, len(data) - 8):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        with pytest.raises(WeightsError, match="corrupt or truncated"):
            read_safetensors_header(tmp_path / "cut.safetensors")


def test_gpt2_names_without_the_transformer_prefix(tmp_path):
    """Hub GPT-2 files (written before GPT2LMHeadModel) say 'h.0.ln_1.weight', not
    'transformer.h.0.ln_1.weight', and keep an attn.bias mask buffer: both are handled."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                     bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = ModelConfig.from_folder(tmp_path)
    w = load_weights(tmp_path, cfg)
    assert w.unused_tensors == ["h.0.attn.bias"]
    ids = np.arange(10) * 7
    np.testing.assert_allclose(Transformer(cfg, w).forward(ids), hf_logits(hf, ids), atol=TOLERANCE)


# --- any such folder runs from the command line -----------------------------------------------------
def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (256 byte pieces, <|endoftext|>, fillers up to the 300 ids of the
    tiny models) so a tiny model folder is complete."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<|endoftext|>": 256} | {f"<x{i}>": i for i in range(257, VOCAB)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.mark.reference
@pytest.mark.parametrize("name, rows", [
    ("gpt2", ["gpt2", "learned table [64, 64]", "LayerNorm (with bias)", "up, GELU tanh, down", "q/k/v, o, mlp"]),
    ("qwen3", ["qwen3", "RoPE theta 10000", "SwiGLU", "qk_norm", "model.layers.0.self_attn.rotary_emb.inv_freq"]),
])
def test_minillm_run_on_a_tiny_folder_traces_its_family(name, rows, built, tmp_path):
    import os
    import subprocess
    import sys

    folder, _ = built(name)
    write_byte_tokenizer(folder)
    proc = subprocess.run([sys.executable, "-m", "minillm", "run", "--model", str(folder), "hello", "-n", "3",
                           "-v", "full"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "150"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for row in rows:  # the load phase under -v full: family, the flags that set it apart, unused tensors
        assert row in proc.stdout, row
