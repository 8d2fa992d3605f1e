"""The forward pass on a tiny random Llama (transformers, seeded): parity, cache, causal mask."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.errors import KVCacheFullError, KVCacheMismatchError
from minillm.model import primitives
from minillm.model.kv_cache import KVCache

VOCAB = 300  # tests/conftest.py's tiny_llama (TINY_LLAMA_VOCAB)


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor(ids[None])).logits[0].numpy()


def test_prefill_and_decode_match_transformers(tiny_llama, rng):
    hf, model = tiny_llama
    ids = rng.integers(0, VOCAB, size=24)
    expected = hf_logits(hf, ids)  # [24, vocab]
    cache = KVCache.for_model(model.config, max_seq_len=64)
    got = [model.forward(ids[:16], cache)]  # prefill 16 positions
    for t in range(16, 24):  # 8 decode steps, one position each
        got.append(model.forward(ids[t : t + 1], cache))
    got = np.concatenate(got)
    assert got.dtype == np.float32
    assert np.abs(got - expected).max() < 1e-4
    assert cache.length == 24


def test_cached_decode_equals_full_recomputation(tiny_llama, rng):
    _, model = tiny_llama
    ids = rng.integers(0, VOCAB, size=20)
    cache = KVCache.for_model(model.config, max_seq_len=32)
    steps = [model.forward(ids[:5], cache, last_only=True)[0]]
    for t in range(5, 20):
        steps.append(model.forward(ids[t : t + 1], cache)[0])
    full = model.forward(ids)  # no cache: attends over all 20 positions from scratch
    np.testing.assert_allclose(np.stack(steps), full[4:], atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_changing_a_later_token_never_changes_earlier_logits(tiny_llama, data):
    _, model = tiny_llama
    n = data.draw(st.integers(2, 24), label="length")
    ids = np.array(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)))
    pos = data.draw(st.integers(1, n - 1), label="changed position")
    changed = ids.copy()
    changed[pos] = (ids[pos] + data.draw(st.integers(1, VOCAB - 1))) % VOCAB
    a, b = model.forward(ids), model.forward(changed)
    np.testing.assert_array_equal(a[:pos], b[:pos])  # exactly equal, not merely close
    assert not np.array_equal(a[pos:], b[pos:])


def test_causal_mask_picture():
    mask = primitives.causal_mask(4, 4)
    assert (mask == 0).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
    ]
    step = primitives.causal_mask(1, 5, offset=4)  # a decode step at position 4 sees all 5 keys
    assert (step == 0).all() and step.shape == (1, 5)
    assert mask.dtype == np.float32 and np.isneginf(mask[0, 1])


def test_kv_cache_sizes_and_errors(tiny_llama):
    _, model = tiny_llama
    cfg = model.config
    cache = KVCache.for_model(cfg, max_seq_len=10)
    assert cache.keys.shape == (3, 2, 10, 8)
    assert cache.nbytes == 2 * 3 * 2 * 8 * 10 * 4
    assert cache.bytes_per_token == 2 * 3 * 2 * 8 * 4 == cfg.kv_bytes_per_token()
    model.forward(np.arange(6), cache)
    assert cache.length == 6 and cache.used_bytes == 6 * cache.bytes_per_token
    with pytest.raises(KVCacheFullError, match="holds 10 positions, 6 are filled and 5 more"):
        model.forward(np.arange(5), cache)
    assert cache.length == 6  # a refused write changes nothing
    cache.truncate(2)
    assert cache.length == 2
    cache.reset()
    assert cache.length == 0
    other = KVCache(num_layers=2, num_kv_heads=2, head_dim=8, max_seq_len=10)
    with pytest.raises(KVCacheMismatchError, match="KVCache.for_model"):
        model.forward(np.arange(3), other)
    with pytest.raises(KVCacheFullError, match="longer than the model's context of 128"):
        KVCache.for_model(cfg, max_seq_len=129)


# --- chunked prefill and kept caches (several tokens written after positions already there) -------
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_split_into_chunks_gives_the_full_forward(tiny_llama, data):
    """Prefill a prompt chunk by chunk into one cache: every chunk's logits equal the one-pass
    forward's rows (the causal mask with an offset), and transformers' logits, within 1e-4."""
    hf, model = tiny_llama
    n = data.draw(st.integers(2, 40), label="prompt length")
    ids = np.asarray(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n), label="ids"))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=6), label="chunk boundaries"))
    whole = model.forward(ids)  # [n, vocab], no cache: every position in one call
    cache = KVCache.for_model(model.config, max_seq_len=n)
    chunks = [model.forward(ids[a:b], cache) for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    got = np.concatenate(chunks)  # [n, vocab]
    assert cache.length == n
    np.testing.assert_allclose(got, whole, atol=1e-5, rtol=0)
    assert np.abs(got - hf_logits(hf, ids)).max() < 1e-4


def test_a_second_turn_on_a_kept_cache_equals_recomputation(tiny_llama, rng):
    """Turn 1 prefills and decodes; turn 2 appends several tokens to the same cache (no reset):
    its logits equal recomputing the whole conversation from nothing, and transformers'."""
    hf, model = tiny_llama
    turn1, turn2 = rng.integers(0, VOCAB, size=12), rng.integers(0, VOCAB, size=9)
    cache = KVCache.for_model(model.config, max_seq_len=64)
    logits = model.forward(turn1, cache, last_only=True)
    decoded = []
    for _ in range(5):  # five greedy decode steps of turn 1
        decoded.append(int(np.argmax(logits[-1])))
        logits = model.forward(np.array(decoded[-1:]), cache)
    history = np.concatenate([turn1, decoded])
    assert cache.length == len(history)
    second = model.forward(turn2, cache)  # [9, vocab] at positions 17..25
    everything = np.concatenate([history, turn2])
    np.testing.assert_allclose(second, model.forward(everything)[len(history):], atol=1e-5, rtol=0)
    assert np.abs(second - hf_logits(hf, everything)[len(history):]).max() < 1e-4
