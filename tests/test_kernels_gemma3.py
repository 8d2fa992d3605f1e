"""Plain == tuned kernels on Gemma 3 270M (sliding-window layers, QK-norm, GeGLU, a 262,144-word head).

A module of its own so that only Gemma 3 is loaded beside the session's models (1 GiB of float32
weights; the 3 GB budget a process). Plain and tuned share the weights (two ``Transformer`` objects
over the same arrays), logits within :data:`TOLERANCE`
(float32 rounding through every layer). Prefills of 1 to 129 tokens compare every row's logits; the 600-token one
(past the 512-position sliding window, attention in causal chunks in every layer) compares the last
row's logits and every layer's keys and values of all 600 positions (the rows' logits would be
629 MB a copy). Batched decode steps of 1, 8 and 32 rows through the paged pool: every row.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import batched_decode_logits, release_memory

import minillm
from minillm.kernels.tuned import TUNED
from minillm.model.kernels import PLAIN
from minillm.model.transformer import Transformer

pytestmark = pytest.mark.slow
#: Float32 rounding of the other formulations through 18 layers, measured plain vs tuned: prefill
#: of 129 tokens 2.5e-4, the 600-token one's last row 1.8e-4, batched decode of 8 and 32 rows 3.9e-4
#: and 4.3e-4 (Gemma's logits are larger than SmolLM2's; 1 to 64 tokens and one row within 1e-4).
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def both():
    """Gemma 3 loaded by minillm (tuned, the default) and a plain Transformer on its weights."""
    model = minillm.load("gemma3-270m", progress=False)
    assert model.transformer.kernels is TUNED
    yield {"plain": Transformer(model.config, model.transformer.weights, PLAIN), "tuned": model.transformer}
    del model
    release_memory()


@pytest.mark.parametrize("tokens", [1, 2, 5, 64, 129])
def test_prefill_logits_plain_equal_tuned(both, tokens):
    ids = np.random.default_rng(tokens).integers(0, 262144, tokens)
    logits = {}
    for name, model in both.items():
        logits[name] = model.forward(ids, minillm.KVCache.for_model(model.config, max_seq_len=tokens))
    assert logits["plain"].shape == (tokens, 262144)
    assert np.abs(logits["plain"] - logits["tuned"]).max() < TOLERANCE


def test_a_600_token_prefill_plain_equal_tuned_logits_and_every_key(both):
    ids = np.random.default_rng(600).integers(0, 262144, 600)
    logits, caches = {}, {}
    for name, model in both.items():
        caches[name] = minillm.KVCache.for_model(model.config, max_seq_len=600)
        logits[name] = model.forward(ids, caches[name], last_only=True)  # [1, vocab]
    assert caches["plain"].length == caches["tuned"].length == 600
    assert np.abs(logits["plain"] - logits["tuned"]).max() < TOLERANCE
    assert np.abs(caches["plain"].keys - caches["tuned"].keys).max() < TOLERANCE  # [layers, kv_heads, 600, head_dim]
    assert np.abs(caches["plain"].values - caches["tuned"].values).max() < TOLERANCE


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_batched_decode_logits_plain_equal_tuned(both, batch):
    plain, tuned = (batched_decode_logits(both[name], batch) for name in ("plain", "tuned"))
    assert plain.shape == (2, batch, 262144)
    assert np.abs(plain - tuned).max() < TOLERANCE
