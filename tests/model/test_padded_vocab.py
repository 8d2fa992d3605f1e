"""A model whose embedding has more rows than its tokenizer has tokens (issue 18, item 3).

Real models pad their vocabulary (Qwen2.5: 151,936 rows, 151,665 tokens). Here: a tiny random
llama with ``vocab_size`` 320 and a 260-entry byte-level tokenizer, its padded rows (260..319)
scaled up so greedy decoding emits them. Every id the model emits must be displayable
(``<id 287>``), decode as transformers' tokenizer decodes it (expected text from
``PreTrainedTokenizerFast.decode`` on the same folder), and never crash a trace, a stream or the
CLI. The untraced ids must equal transformers' own greedy ``generate`` (the reference model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import minillm
from minillm import SamplingParams, Tracer
from tiny_families import Case, build

pytestmark = pytest.mark.reference

ROWS, TOKENS = 320, 260  # the model's vocab_size, the tokenizer's entries
PADDED = Case("LlamaConfig", dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, tie_word_embeddings=False))


def write_260_token_tokenizer(folder: Path) -> None:
    """256 byte pieces, <|endoftext|> (256, special), 3 fillers: 260 entries."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<|endoftext|>": 256} | {f"<x{i}>": i for i in range(257, TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """(folder, transformers model): vocab_size 320, the padded rows of lm_head scaled by 6."""
    import torch
    import transformers

    folder, _ = build(PADDED, tmp_path_factory.mktemp("padded"), seed=3, vocab=ROWS)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"][TOKENS:] *= 6  # padded ids win most steps (a real model would never pick them)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_260_token_tokenizer(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return folder, hf.eval()


def hf_decode(folder: Path, ids: list[int]) -> str:
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder)).decode(ids, skip_special_tokens=True)


def test_traced_generation_shows_padded_ids_and_decodes_as_transformers(padded):
    import torch

    folder, hf = padded
    model = minillm.load(folder, progress=False)
    assert model.config.vocab_size == ROWS and model.tokenizer.vocab_size == TOKENS
    greedy = SamplingParams(temperature=0.0)
    untraced = minillm.generate(model, "hello", greedy, max_new_tokens=12)
    prompt = model.tokenizer.encode("hello").tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert untraced.ids == ref  # the reference model emits the padded ids too
    padded_ids = [i for i in ref if i >= TOKENS]
    assert padded_ids, "the test model must emit padded ids"

    tracer = Tracer()
    traced = minillm.generate(model, "hello", greedy, max_new_tokens=12, tracer=tracer)
    assert traced.ids == ref
    assert traced.text == hf_decode(folder, ref)  # padded ids have no text, as in transformers
    decodes = [e.data for e in tracer.events if e.phase == "decode"]
    for step in decodes:
        for token, piece in ((step["token"], step["piece"]), (step["input_token"], step["input_piece"])):
            assert piece == (f"<id {token}>" if token >= TOKENS else model.tokenizer.piece_for_display(token))
    shown = [c for step in decodes for c, _ in step["candidates"]]
    assert any(c.startswith("<id ") for c in shown)  # padded candidates are shown, by number
    # Sampling (every id reachable) through the stream, with a trace: the same text as the full decode.
    tracer = Tracer()
    out: list = []
    deltas = list(minillm.stream(model, "hello", SamplingParams(temperature=1.5, seed=0), max_new_tokens=20,
                                 tracer=tracer, result=out))
    assert "".join(deltas) == out[0].text == hf_decode(folder, out[0].ids)


def test_minillm_run_on_the_padded_model(padded):
    folder, _ = padded
    proc = subprocess.run([sys.executable, "-m", "minillm", "run", "--model", str(folder), "hello", "-n", "8",
                           "-v", "full"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "150"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "<id " in proc.stdout and "not in the vocabulary" not in proc.stdout + proc.stderr
    trace = subprocess.run([sys.executable, "-m", "minillm", "run", "--model", str(folder), "hello", "-n", "8",
                            "--trace", "json"], capture_output=True, text=True, timeout=300)
    assert trace.returncode == 0, trace.stderr
    events = [json.loads(line) for line in trace.stdout.splitlines() if line.startswith("{")]
    assert any(e["phase"] == "decode" and e["data"]["piece"].startswith("<id ") for e in events)


def test_piece_for_display_of_ids_without_text(padded):
    folder, _ = padded
    tok = minillm.load(folder, progress=False).tokenizer
    assert tok.piece_for_display(287) == "<id 287>"
    assert tok.decode([104, 287, 105]) == hf_decode(folder, [104, 287, 105])
    with pytest.raises(minillm.MiniLLMError, match="token ids must be >= 0"):
        tok.decode([-1])
    with pytest.raises(minillm.MiniLLMError, match="token id -1 is not in the vocabulary"):
        tok.piece_for_display(-1)
