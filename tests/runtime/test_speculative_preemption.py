"""Speculative decoding under preemption (issue 47): greedy speculative ids equal plain greedy ids when
the KV pool is so small that the scheduler preempts and recomputes, for k = 1..8, adaptive and fixed,
in pools from one request's size up, through ``generate_batch`` (the server's path: tests/serve/
test_speculative_preemption_server.py).

What could go wrong (vLLM once kept a preempted request's draft tokens): a draft proposed for a request
that is then preempted, drafted positions fed again at its recompute, an adaptive ``k`` or a block
table left from before the preemption, a rejected draft's block named in the prefix cache that a
recompute reuses. One batch per pool holds eight requests (k = 1..8, odd adaptive, even fixed) on three
prompts that repeat themselves (prompt lookup drafts long runs), blocks of 4 positions so that most
steps cross a block; the reference is ``generate`` alone, greedy, no draft.

Model: SmolLM2-135M-Instruct (the session's), 12 new tokens a request.
"""

from __future__ import annotations

import pytest

import minillm
from minillm import Speculative

pytestmark = pytest.mark.slow

# 8, 5 and 12 tokens: the first two fit a pool of the third's size together, then their decodes
# outgrow it and the newer is preempted
PROMPTS = ("a b c a b c a b", "one two one two one", "the cat sat on the mat. the cat sat on the")
NEW = 12
BLOCK = 4
GREEDY = minillm.SamplingParams(temperature=0.0)
# k = 1..8, odd k adaptive (k grows from 1 up to it), even k fixed (k drafts every pass)
SPECS = [Speculative("ngram", num_tokens=k, adaptive=k % 2 == 1, prompt_lookup_min=1) for k in range(1, 9)]


@pytest.fixture(scope="module")
def plain(smollm2) -> dict[str, list[int]]:
    """Each prompt's greedy ids from ``generate`` alone (no pool, no draft)."""
    return {p: minillm.generate(smollm2, p, GREEDY, max_new_tokens=NEW).ids for p in PROMPTS}


def one_request_blocks(model) -> int:
    """Blocks the larger request needs at most: its prompt and ``NEW - 1`` fed tokens."""
    return max(-(-(len(minillm.tokenize(model, p)) + NEW - 1) // BLOCK) for p in PROMPTS)


@pytest.mark.parametrize("extra_blocks", [0, 3])
def test_greedy_speculative_ids_equal_plain_ids_under_preemption(smollm2, plain, extra_blocks):
    """A pool of one request's blocks (then three more: two requests run, and the newer is preempted):
    every request, whatever its k, gets exactly the plain greedy ids; preemptions happened, and some
    request that was preempted had kept drafts (so a recompute followed a verified draft)."""
    blocks = one_request_blocks(smollm2) + extra_blocks
    bytes_per_block = minillm.KVCachePool.for_model(smollm2.config, 1, block_size=BLOCK).bytes_per_block
    prompts = [PROMPTS[j % 3] for j in range(len(SPECS))]
    results = minillm.generate_batch(
        smollm2,
        prompts,
        GREEDY,
        max_new_tokens=NEW,
        kv_cache_mib=blocks * bytes_per_block / 2**20,
        block_size=BLOCK,
        per_prompt=[{"speculative": spec} for spec in SPECS],
    )
    for prompt, spec, got in zip(prompts, SPECS, results, strict=True):
        assert got.ids == plain[prompt], (spec, got.text)
    preempted = [r for r in results if r.metrics.preemptions > 0]
    assert preempted and any(r.metrics.accepted_tokens > 0 for r in preempted)
    assert all(r.metrics.drafted_tokens > 0 for r in results)
