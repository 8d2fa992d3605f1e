"""The continuous-batching scheduler's policy (minillm/runtime/scheduler.py), step by step, on
conftest's tiny random Llama (3 layers, vocabulary 300): which rows each step feeds, who is
preempted and where it waits, a pool sized for every request, the prefix-cache count after a
preemption (issue 31, kind 4). Seconds, not minutes: every expected value is worked out by hand
in the comments from the scheduler's rules (running requests first, oldest first; then waiting
ones in arrival order while the token budget and free blocks allow; a decode that finds no free
block preempts the newest request, which waits at the front).

The vocabulary is 300 words ``w0`` .. ``w299`` with no EOS id: every request ends on its
``max_new_tokens``, so the counts do not depend on what the random model samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import minillm
from minillm.model.paged_kv_cache import KVCachePool
from minillm.runtime.loading import Model
from minillm.runtime.scheduler import BatchRequest, Scheduler
from minillm.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> Model:
    """The tiny Llama behind a whole-word tokenizer of its 300 ids, no EOS, no BOS."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers
    from tokenizers.models import WordLevel

    _, transformer = tiny_llama
    vocab = {f"w{i}": i for i in range(transformer.config.vocab_size)}
    backend = Backend(WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = Tokenizer(backend)
    assert tokenizer.eos_token_ids == frozenset()
    return Model("tiny-llama", Path("."), transformer.config, tokenizer, transformer, None)


def words(start: int, n: int) -> str:
    """A prompt of exactly ``n`` tokens: ids start .. start + n - 1."""
    return " ".join(f"w{i}" for i in range(start, start + n))


def steps_of(tracer) -> list[dict]:
    return [e.data for e in tracer.events if e.phase == "batch_step"]


def rows_of(steps) -> list[list[tuple[int, int]]]:
    """Per step: (request, tokens fed), in the order the scheduler fed them."""
    return [[(r["request"], r["tokens"]) for r in s["rows"]] for s in steps]


def test_a_fixed_workload_feeds_exactly_these_rows_in_exactly_ten_steps(tiny):
    """Prompts of 5, 20 and 9 tokens, 4, 3 and 6 new tokens, 8 tokens per step:
    step 1: r0's prompt (5) + the first 3 of r1's (budget spent); r0 samples.
    steps 2-3: r0 decodes (1), r1 takes 7 more each (to 17).
    step 4: r0's 4th token ends it; r1's last 3 (then it samples); r2 joins with 4 of its 9.
    step 5: r1 decodes, r2's last 5.  step 6: r1's 3rd token ends it; r2 decodes.
    steps 7-10: r2 decodes to its 6th token.
    Fed in all: each prompt + its new tokens - 1 (the last is never fed) = 8 + 22 + 14 = 44."""
    prompts = [words(10, 5), words(30, 20), words(60, 9)]
    tracer = minillm.Tracer()
    results = minillm.generate_batch(tiny, prompts, max_new_tokens=[4, 3, 6], max_batched_tokens=8, tracer=tracer)
    steps = steps_of(tracer)
    assert rows_of(steps) == [
        [(0, 5), (1, 3)],
        [(0, 1), (1, 7)],
        [(0, 1), (1, 7)],
        [(0, 1), (1, 3), (2, 4)],
        [(1, 1), (2, 5)],
        [(1, 1), (2, 1)],
        [(2, 1)],
        [(2, 1)],
        [(2, 1)],
        [(2, 1)],
    ]
    assert [s["finished"] for s in steps] == [[], [], [], [0], [], [1], [], [], [], [2]]
    assert sum(n for step in rows_of(steps) for _, n in step) == 44
    assert [r.metrics.new_tokens for r in results] == [4, 3, 6]
    assert [r.metrics.prompt_tokens_computed for r in results] == [5, 20, 9]
    assert all(r.stop_reason is minillm.StopReason.MAX_NEW_TOKENS for r in results)


def test_a_pool_sized_for_every_request_never_preempts(tiny):
    """generate_batch's default pool: for each request ceil((prompt + new - 1) / block) blocks.
    Blocks of 4, 4 new tokens each: prompts of 5, 9, 1 and 3 tokens need 8, 12, 4 and 6 positions
    = 2, 3, 1 and 2 blocks (the first three's last block exactly full, the fourth's half): 8.
    Everyone is admitted in step 1 (7 blocks for the prompts); the fourth takes its second block in
    step 3, so all 8 are in use when all four feed their last position in step 4, and no one is
    preempted: with the default pool and with a pool of exactly those 8 blocks."""
    prompts = [words(10, 5), words(40, 9), words(80, 1), words(90, 3)]
    for pool in (None, KVCachePool(3, 2, 8, num_blocks=8, block_size=4)):
        tracer = minillm.Tracer()
        results = minillm.generate_batch(tiny, prompts, max_new_tokens=4, block_size=4, pool=pool, tracer=tracer)
        steps = steps_of(tracer)
        assert steps[0]["blocks_total"] == 8
        assert steps[0]["admitted"] == {0: 0, 1: 0, 2: 0, 3: 0} and steps[0]["waiting"] == []
        assert rows_of(steps) == [[(0, 5), (1, 9), (2, 1), (3, 3)]] + [[(0, 1), (1, 1), (2, 1), (3, 1)]] * 3
        assert [s["blocks_used"] for s in steps] == [7, 7, 8, 0]  # after step 4 all four have ended
        assert [s["preempted"] for s in steps] == [[], [], [], []]
        assert [r.metrics.preemptions for r in results] == [0, 0, 0, 0]
        assert [r.metrics.new_tokens for r in results] == [4, 4, 4, 4]


def batch_request(model, pool, index, prompt, new):
    return BatchRequest(model, prompt, None, pool=pool, index=index, max_new_tokens=new)


def test_a_preempted_request_waits_at_the_front_and_keeps_its_first_cached_count(tiny):
    """Blocks of 4, a pool of 5, two running at once; three 4-token prompts with 8 new tokens
    (4 + 8 - 1 = 11 positions = 3 blocks each). r0 and r1 take a block each in step 1 and a
    second in step 2 (positions 4-7); r2 waits (two already run). In step 6 r0 feeds position 8:
    it takes the last free block; r1 then needs a third and finds none: r1, the newest, is
    preempted and waits *before* r2, which arrived later. When r0 ends, r1 comes back first, its
    two full blocks (8 tokens) found again in the prefix cache: its ``cached_prompt_tokens`` stays
    0, what its prompt found at its first admission, not the positions its own recompute reused."""
    pool = KVCachePool(3, 2, 8, num_blocks=5, block_size=4)
    scheduler = Scheduler(tiny, pool, max_batched_tokens=64, max_num_seqs=2)
    requests = [batch_request(tiny, pool, i, words(100 + 10 * i, 4), 8) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    for _ in range(5):
        scheduler.step()
    assert [r.index for r in scheduler.running] == [0, 1] and [r.index for r in scheduler.waiting] == [2]
    assert [len(r.seq.block_table) for r in scheduler.running] == [2, 2] and pool.num_free_blocks == 1
    scheduler.step()  # step 6
    assert [r.index for r in scheduler.running] == [0]
    assert [r.index for r in scheduler.waiting] == [1, 2]  # the preempted one at the front
    assert requests[1].metrics.preemptions == 1 and requests[1].seq.block_table == []
    assert len(requests[1].new_ids) == 5  # sampled in steps 1-5; recomputed later, not resampled
    while requests[0].result is None:
        scheduler.step()
    scheduler.step()  # r1 is admitted again: 9 ids known, the first 8 in two cached blocks
    assert [r.index for r in scheduler.running][:1] == [1]
    assert requests[1].seq.cached_tokens == 8
    assert requests[1].metrics.cached_prompt_tokens == 0
    while scheduler.has_work():
        scheduler.step()
    assert [r.result.metrics.new_tokens for r in requests] == [8, 8, 8]
    assert requests[0].metrics.preemptions == 0
    assert [r.result.metrics.cached_prompt_tokens for r in requests] == [0, 0, 0]


def test_cached_prompt_tokens_after_a_preemption_is_the_shared_prefix_found_first(tiny):
    """Blocks of 4, a pool of 4, 5 tokens per step, two running at once; 5-token prompts with 7
    new tokens (11 positions = 3 blocks). r1's prompt starts with r0's first 4 tokens. Step 1
    feeds r0's whole prompt (the budget), which fills and names its first block; in step 2 r1
    joins and finds that block: 4 cached prompt tokens. In step 6 r1 needs its third block, none
    is free (r0 holds 3, r1 2 of which one shared): r1 is preempted. Admitted again when r0 ends,
    it finds 8 tokens in the cache (the shared block and its own second one); it still reports 4."""
    pool = KVCachePool(3, 2, 8, num_blocks=4, block_size=4)
    scheduler = Scheduler(tiny, pool, max_batched_tokens=5, max_num_seqs=2)
    shared = words(100, 4)
    prompts = [shared + " w150", shared + " w160", words(200, 5)]
    requests = [batch_request(tiny, pool, i, p, 7) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.add(r)
    for _ in range(6):
        scheduler.step()
    assert requests[1].metrics.preemptions == 1 and requests[1].metrics.cached_prompt_tokens == 4
    assert [r.index for r in scheduler.waiting] == [1, 2]
    while requests[0].result is None:
        scheduler.step()
    scheduler.step()
    assert scheduler.running[0] is requests[1] and requests[1].seq.cached_tokens == 8
    assert requests[1].metrics.cached_prompt_tokens == 4
    while scheduler.has_work():
        scheduler.step()
    assert requests[1].metrics.cached_prompt_tokens == 4
    assert [r.result.metrics.new_tokens for r in requests] == [7, 7, 7]
