"""The real model: SmolLM2-135M-Instruct (dequantized from the Q4_1 GGUF) against transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import minillm
from minillm import KVCache, SamplingParams, StopReason

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def hf_greedy(hf, ids: np.ndarray, max_new_tokens: int, eos_token_id) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor(ids[None]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return out[0, len(ids):].tolist()


def test_greedy_completion_says_paris(smollm2, hf_smollm2):
    result = minillm.generate(smollm2, "The capital of France is", GREEDY, max_new_tokens=12)
    assert result.text.startswith(" Paris.")
    assert result.stop_reason is StopReason.MAX_NEW_TOKENS and len(result.ids) == 12
    expected = hf_greedy(hf_smollm2, np.array(result.prompt_ids), 12, eos_token_id=None)
    assert result.ids == expected


def test_greedy_chat_matches_transformers_token_for_token(smollm2, hf_smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = minillm.generate(smollm2, messages, GREEDY, max_new_tokens=64)
    assert result.prompt_ids[0] == 1  # <|im_start|>, nothing prepended
    assert result.stop_reason is StopReason.EOS
    assert result.ids[-1] == 2  # <|im_end|>
    assert "Paris" in result.text and "<|im_end|>" not in result.text
    expected = hf_greedy(hf_smollm2, np.array(result.prompt_ids), 64, eos_token_id=2)
    assert result.ids == expected


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers_at_prefill_and_8_decode_steps(smollm2, hf_smollm2, prompt):
    import torch

    ids = minillm.tokenize(smollm2, prompt)
    cache = KVCache.for_model(smollm2.config, max_seq_len=len(ids) + 8)
    ours = [minillm.prefill(smollm2, ids, cache)]
    fed = list(ids)
    for _ in range(8):
        token = minillm.sample(ours[-1], GREEDY)
        fed.append(token)
        ours.append(minillm.decode_step(smollm2, token, cache))
    assert cache.length == len(ids) + 8
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([fed])).logits[0].numpy()  # [len(ids) + 8, vocab]
    ref = ref[len(ids) - 1 :]  # the prefill's last position, then each decode step
    diff = np.abs(np.stack(ours) - ref).max()
    assert diff < 1e-4, f"max abs logit difference {diff:.2e}"


def test_cached_decoding_equals_recomputation_on_the_real_model(smollm2):
    ids = minillm.tokenize(smollm2, "The capital of France is")
    cache = KVCache.for_model(smollm2.config, max_seq_len=len(ids) + 4)
    logits = minillm.prefill(smollm2, ids, cache)
    seq = list(ids)
    for _ in range(4):
        token = minillm.sample(logits, GREEDY)
        seq.append(token)
        logits = minillm.decode_step(smollm2, token, cache)
        full = smollm2.transformer.forward(np.array(seq), None, last_only=True)[0]
        np.testing.assert_allclose(logits, full, atol=1e-4)  # same math, other GEMM shapes: float32 rounding


def test_chat_template_and_ids_match_transformers(smollm2):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(smollm2.path)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    ours = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert minillm.tokenize(smollm2, messages).tolist() == hf_tok(ours, add_special_tokens=False)["input_ids"]
    for text in ["The capital of France is", "Hello, world!\n  indented", "naïve café ☕"]:
        assert minillm.tokenize(smollm2, text).tolist() == hf_tok(text)["input_ids"]


def test_kv_cache_nbytes_formula(smollm2):
    cfg = smollm2.config
    cache = KVCache.for_model(cfg, max_seq_len=100)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (30, 3, 64)
    assert cache.nbytes == 2 * 30 * 3 * 64 * 100 * 4
    assert cache.bytes_per_token == 46_080


def test_second_run_uses_the_cache_without_network_or_conversion(smollm2, tmp_path):
    """Run the CLI in a fresh process where any socket connection or conversion raises."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import socket
        def _no_network(*args, **kwargs):
            raise RuntimeError("network call attempted")
        socket.socket.connect = _no_network
        socket.create_connection = _no_network
        import minillm.sources.gguf_import as gi
        def _no_conversion(*args, **kwargs):
            raise RuntimeError("conversion attempted")
        gi.import_gguf = _no_conversion
        import subprocess
        _run = subprocess.run
        def _no_pip(cmd, *a, **k):
            if "pip" in " ".join(map(str, cmd)):
                raise RuntimeError("pip download attempted")
            return _run(cmd, *a, **k)
        subprocess.run = _no_pip
    """))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "minillm.cli", "run", "The capital of France is", "-n", "3",
         "--trace-json", str(tmp_path / "trace.jsonl")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "source: cache" in proc.stdout
    assert "Paris" in proc.stdout
