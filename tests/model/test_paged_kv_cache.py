"""The paged KV cache pool (minillm/model/paged_kv_cache.py): paged == contiguous, the pool's
arithmetic, prefix caching (chained hashes, reference counts, LRU eviction) and its errors.

Where expected values come from: logits from transformers (the reference) and from the contiguous
KVCache, whose own parity with transformers is tested in test_forward_tiny.py / test_smollm2.py;
sizes and block ids worked out by hand in the comments; hashes from hashlib directly.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.errors import InvalidRequestError, KVCacheFullError
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import KVCache
from minillm.model.paged_kv_cache import KVCachePool
from minillm.model.transformer import Transformer
from minillm.model.weights import load_weights

VOCAB = 300  # tests/conftest.py's tiny_llama (TINY_LLAMA_VOCAB)


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids)[None])).logits[0].numpy()


def run_paged_and_contiguous(model, ids, cuts, block_size, num_blocks):
    """Feed ``ids`` in the chunks ``cuts`` into a contiguous cache and into a paged sequence whose
    blocks are interleaved with another sequence's (so its table is scattered); return both
    logits ``[n, vocab]`` and the paged sequence."""
    contiguous = KVCache.for_model(model.config, max_seq_len=len(ids))
    pool = KVCachePool(3, 2, 8, num_blocks=num_blocks, block_size=block_size)
    other, paged = pool.sequence(10_000), pool.sequence(len(ids))
    a, b = [], []
    for lo, hi in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        pool.grow(other, 2)  # another sequence takes blocks between this one's
        other.advance(2)
        pool.grow(paged, hi - lo)
        a.append(model.forward(ids[lo:hi], contiguous))
        b.append(model.forward(ids[lo:hi], paged))
    return np.concatenate(a), np.concatenate(b), paged


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_paged_equals_contiguous_for_any_block_size_and_chunking(tiny_llama, data):
    """Any block size, any split into chunks, blocks scattered in the pool: the paged logits equal
    the contiguous cache's within 1e-5 and transformers' within 1e-4."""
    hf, model = tiny_llama
    n = data.draw(st.integers(2, 80), label="length")
    ids = np.asarray(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n), label="ids"))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=8), label="chunk boundaries"))
    block_size = data.draw(st.sampled_from([1, 3, 16, 64]), label="block size")
    contiguous, paged, seq = run_paged_and_contiguous(model, ids, cuts, block_size, num_blocks=400)
    np.testing.assert_allclose(paged, contiguous, atol=1e-5, rtol=0)
    assert np.abs(paged - hf_logits(hf, ids)).max() < 1e-4
    assert seq.length == n and len(seq.block_table) == -(-n // block_size)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_equals_contiguous_on_smollm2_over_16_decode_steps(smollm2, block_size):
    """SmolLM2, a 58-token prompt in two chunks (0-29, 30-57: with 16-position blocks the second
    chunk crosses blocks at 32 and 48 within one forward pass), then 16 greedy decode steps
    (positions 58-73: crossing 64 for block sizes 16 and 64, every step for 1)."""
    model = smollm2.transformer
    text = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg " * 4
    ids = list(smollm2.tokenizer.encode(text)[:58])
    assert len(ids) == 58
    contiguous = KVCache.for_model(smollm2.config, max_seq_len=80)
    pool = KVCachePool.for_model(smollm2.config, kv_cache_mib=16, block_size=block_size)
    other, paged = pool.sequence(10_000), pool.sequence(80)
    a, b = [], []
    feeds = [ids[:30], ids[30:]]
    for step in range(18):
        chunk = np.asarray(feeds[step] if step < 2 else [int(np.argmax(a[-1][-1]))])
        pool.grow(other, 5)  # interleave another sequence's blocks
        other.advance(5)
        pool.grow(paged, len(chunk))
        a.append(model.forward(chunk, contiguous))
        b.append(model.forward(chunk, paged))
    a, b = np.concatenate(a), np.concatenate(b)  # [74, vocab]
    assert paged.length == 74 and len(paged.block_table) == -(-74 // block_size)
    if block_size < 64:  # the other sequence's blocks sit between this one's
        assert (np.diff(paged.block_table) != 1).any()
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_pool_arithmetic_for_smollm2_by_hand(smollm2):
    """64 MiB on SmolLM2: 2 (k, v) * 30 layers * 3 kv heads * 64 dims * 4 bytes = 46,080 bytes per
    position; 16 positions = 737,280 bytes per block; 67,108,864 / 737,280 = 91.02 -> 91 blocks."""
    pool = KVCachePool.for_model(smollm2.config, kv_cache_mib=64)
    assert pool.bytes_per_token == 46_080
    assert pool.bytes_per_block == 737_280
    assert pool.num_blocks == 91
    assert pool.nbytes == 91 * 737_280
    assert pool.blocks_for(512) == 32 and pool.blocks_for(513) == 33


# --- prefix caching ----------------------------------------------------------------------------
def small_pool(num_blocks=8, block_size=4) -> KVCachePool:
    return KVCachePool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size)


def computed(pool, ids):
    """Allocate a sequence for ``ids`` and mark every position computed (as a forward pass would)."""
    seq = pool.sequence(100)
    cached = pool.allocate(seq, ids)
    seq.advance(len(ids) - seq.length)
    pool.register_full_blocks(seq, ids)
    return seq, cached


def test_block_hashes_are_chained_over_token_ids():
    pool = small_pool()
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    h0 = hashlib.blake2b(np.array([5, 6, 7, 8], dtype=np.int64).tobytes(), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + np.array([9, 10, 11, 12], dtype=np.int64).tobytes(), digest_size=16).digest()
    assert pool.block_hashes(ids) == [h0, h1]  # the partial third block has no hash
    # the same second block after a different first block is another block: keys depend on the past
    assert pool.block_hashes([1, 6, 7, 8, 9, 10, 11, 12])[1] != h1


def test_prefix_blocks_are_shared_counted_and_whole():
    pool = small_pool(num_blocks=8, block_size=4)
    a, cached_a = computed(pool, list(range(10)))  # blocks 0, 1 full, 2 partial
    assert cached_a == 0 and a.block_table == [0, 1, 2]
    b, cached_b = computed(pool, [*range(8), 99, 98, 97])  # shares the two full blocks
    assert cached_b == 8 and b.block_table[:2] == [0, 1] and b.block_table[2] == 3
    assert pool.ref_count[:4] == [2, 2, 1, 1]
    c, cached_c = computed(pool, [7, *range(1, 8), 5])  # first block differs: nothing shared
    assert cached_c == 0 and not set(c.block_table) & {0, 1}
    # a prompt of exactly two blocks reuses only one: its last token must be computed for logits
    d, cached_d = computed(pool, list(range(8)))
    assert cached_d == 4 and d.block_table[0] == 0 and pool.ref_count[0] == 3


def test_unreferenced_blocks_stay_cached_and_are_evicted_least_recently_freed_first():
    pool = small_pool(num_blocks=6, block_size=4)
    a, _ = computed(pool, list(range(9)))  # blocks 0, 1 (full), 2 (partial)
    b, _ = computed(pool, list(range(100, 109)))  # blocks 3, 4 (full), 5
    pool.release(a)  # free list order after the 0 never-used blocks: 2, 1, 0 (tail first)
    pool.release(b)  # then 5, 4, 3
    assert pool.num_free_blocks == 6 and len(pool.cached) == 4
    assert list(pool.free_blocks) == [2, 1, 0, 5, 4, 3]
    again, cached = computed(pool, list(range(9)))  # a's prefix comes back from the free list
    assert cached == 8 and again.block_table[:2] == [0, 1]
    assert again.block_table[2] == 2  # the least recently freed block: empty, no prefix lost
    pool.release(again)
    # three fresh blocks: the LRU order is now 5, 4, 3, 2, 1, 0 -> b's blocks are evicted, a's stay
    fresh, _ = computed(pool, [50] * 9)
    assert fresh.block_table == [5, 4, 3]
    assert pool.cached_prefix(list(range(100, 109))) == []  # b's prefix is gone
    assert pool.cached_prefix(list(range(9))) == [0, 1]  # a's is still there


def test_can_allocate_counts_shared_blocks_once():
    pool = small_pool(num_blocks=4, block_size=4)
    computed(pool, list(range(9)))  # holds 3 blocks, 1 free
    assert pool.can_allocate([*range(8), 42])  # shares 2 held blocks, needs 1 fresh
    assert not pool.can_allocate(list(range(200, 209)))  # needs 3 fresh
    with pytest.raises(KVCacheFullError, match="has 1 free blocks of 4 .* 3 more were asked for"):
        pool.allocate(pool.sequence(100), list(range(200, 209)))


# --- errors -----------------------------------------------------------------------------------
def test_bad_pool_arguments_name_the_numbers_and_the_fix(smollm2):
    with pytest.raises(InvalidRequestError, match="block_size must be a whole number of positions >= 1, got 0"):
        KVCachePool.for_model(smollm2.config, kv_cache_mib=64, block_size=0)
    # one block of 16 positions on SmolLM2 is 737,280 bytes = 0.703 MiB: half a MiB holds none
    with pytest.raises(InvalidRequestError, match=r"0.5 MiB holds no block.*737,280 bytes.*kv_cache_mib >= 0.703"):
        KVCachePool.for_model(smollm2.config, kv_cache_mib=0.5)
    with pytest.raises(InvalidRequestError, match="at least 1 block, got num_blocks=0"):
        KVCachePool(1, 1, 2, num_blocks=0)
    pool = small_pool(num_blocks=2, block_size=4)
    seq = pool.sequence(100)
    pool.grow(seq, 4)
    with pytest.raises(KVCacheFullError, match="holds 1 blocks .* 0 are filled and 5 more"):
        seq.check_room(5)


# --- the batched forward over paged sequences, on tiny models of two families ----------------------
@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """test_families' Gemma 3 case: sliding window 8 on 3 of 4 layers, QK-norm, local RoPE base."""
    from tiny_families import CASES, build

    folder, hf = build(CASES["gemma3"], tmp_path_factory.mktemp("tiny-gemma3-batch"))
    config = ModelConfig.from_folder(folder)
    return hf, Transformer(config, load_weights(folder, config))


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gemma3"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_forward_batch_rows_equal_each_sequence_alone_and_transformers(family, data, request):
    """2-5 sequences with 1-30 cached positions each (paged, or a contiguous cache), then one
    forward_batch where each feeds a decode row or a chunk of 2-5 tokens: every row within 1e-5 of
    the sequence run alone, and within 1e-4 of transformers' full forward at that position. Decode
    rows of one pool are attended together, padded to the longest context (with Gemma 3's window of
    8, most keys of long sequences are masked out)."""
    hf, model = request.getfixturevalue(family)
    vocab = model.config.vocab_size
    pool = KVCachePool(
        model.config.num_hidden_layers,
        model.config.num_key_value_heads,
        model.config.head_dim,
        num_blocks=200,
        block_size=data.draw(st.sampled_from([1, 4, 16]), label="block size"),
    )
    chunks, expected_alone, expected_hf = [], [], []
    for j in range(data.draw(st.integers(2, 5), label="sequences")):
        past = data.draw(st.integers(1, 30), label=f"cached {j}")
        feed = data.draw(st.sampled_from([1, 1, 2, 5]), label=f"fed {j}")
        ids = np.asarray(data.draw(st.lists(st.integers(0, vocab - 1), min_size=past + feed, max_size=past + feed)))
        contiguous = data.draw(st.booleans(), label=f"contiguous {j}")
        cache = KVCache.for_model(model.config, 64) if contiguous else pool.sequence(64)
        if not contiguous:
            pool.grow(cache, past + feed)
        model.forward(ids[:past], cache)
        alone = KVCache.for_model(model.config, 64)
        model.forward(ids[:past], alone)
        expected_alone.append(model.forward(ids[past:], alone))
        expected_hf.append(hf_logits(hf, ids)[past:])
        chunks.append((ids[past:], cache))
    got = model.forward_batch(chunks, all_logits=True)
    np.testing.assert_allclose(got, np.concatenate(expected_alone), atol=1e-5, rtol=0)
    assert np.abs(got - np.concatenate(expected_hf)).max() < 1e-4


def test_releasing_a_block_another_sequence_holds_keeps_it_alive():
    pool = small_pool(num_blocks=6, block_size=4)
    a, _ = computed(pool, list(range(10)))  # blocks 0, 1 (full), 2 (partial)
    b, cached = computed(pool, [*range(8), 50, 51])  # shares 0 and 1, its own block 3
    assert cached == 8 and b.block_table == [0, 1, 3]
    pool.release(a)
    assert pool.ref_count[:4] == [1, 1, 0, 1]
    assert list(pool.free_blocks) == [4, 5, 2]  # only a's own block joined the free list
    fresh, _ = computed(pool, list(range(100, 112)))  # takes every free block: never 0, 1 or 3
    assert fresh.block_table == [4, 5, 2] and pool.num_free_blocks == 0
    assert pool.cached_prefix([*range(8), 99]) == [0, 1]  # b's prefix still named and held


def test_a_cached_prefix_in_the_free_list_is_taken_back_not_handed_out_twice():
    pool = small_pool(num_blocks=3, block_size=4)
    a, _ = computed(pool, list(range(10)))  # every block: 0, 1 full, 2 partial
    pool.release(a)
    assert pool.num_free_blocks == 3 and pool.can_allocate(list(range(10)))
    again, cached = computed(pool, list(range(10)))
    assert cached == 8 and again.block_table == [0, 1, 2]
    assert pool.num_free_blocks == 0 and pool.ref_count == [1, 1, 1]
    assert not pool.can_allocate([77] * 4)  # the reused blocks left the free list
    with pytest.raises(KVCacheFullError):
        pool.allocate(pool.sequence(100), [77] * 4)
