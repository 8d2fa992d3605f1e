"""Continuous batching (runtime/scheduler.py, Transformer.forward_batch, generate_batch) on the real
SmolLM2: exactness against one request at a time, chunked prefill, preemption, prefix reuse, the
pool's admission arithmetic, the trace, and bad input.

Where expected values come from: transformers' logits (the reference) for the batched rows;
``minillm.generate`` one request at a time for the batched results (its greedy ids are tested
against transformers' in test_smollm2.py); token counts from the tokenizer (``tokenizers``);
block counts worked out by hand in the comments.
"""

from __future__ import annotations

import statistics
import os
import numpy as np
import pytest
from rich.console import Console

import minillm
from minillm.observe.metrics import cpu_snapshot, others_cpu_share
from minillm.errors import InvalidRequestError, KVCachePoolTooSmall
from minillm.model.kv_cache import KVCache
from minillm.model.paged_kv_cache import KVCachePool

pytestmark = pytest.mark.slow

STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens and wrote the weather in a leather book: wind from the west, rain by "
    "midnight, a fishing boat late into the harbour. In {year} the village built a road along the "
    "cliffs, and the keeper counted {n} carts in the first week. "
)


def long_text(k: int) -> str:
    return "".join(STORY.format(year=1800 + i, n=3 * i + 2) for i in range(k))


def prompts_of(model, lengths: list[int]) -> list[str]:
    """Prompts whose token counts are ``lengths`` (cut from one text by token ids, decoded back)."""
    ids = model.tokenizer.encode(long_text(8))
    out = []
    for n in lengths:
        text = minillm.detokenize(model, ids[:n])
        assert len(minillm.tokenize(model, text)) == n  # checked by the tokenizer itself
        out.append(text)
    return out


def hf_logits(hf, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids)[None])).logits[0].numpy()


def test_batched_rows_equal_single_sequence_forward_and_transformers(smollm2, hf_smollm2):
    """Three sequences in one forward_batch: a decode row after 40 cached positions (contiguous
    cache), a fresh 20-token prefill (paged), and a 7-token chunk after 10 cached positions (paged,
    crossing a 16-position block). Every row's logits within 1e-4 of the one-sequence forward on
    its own cache, and of transformers' full forward at the same positions."""
    T = smollm2.transformer
    ids = smollm2.tokenizer.encode(long_text(2))
    a, b, c = ids[:41], ids[50:70], ids[100:117]
    pool = KVCachePool.for_model(smollm2.config, kv_cache_mib=8)
    cache_a = KVCache.for_model(smollm2.config, 64)
    seq_b, seq_c = pool.sequence(64), pool.sequence(64)
    T.forward(a[:40], cache_a)
    pool.grow(seq_c, 17)
    T.forward(c[:10], seq_c)
    pool.grow(seq_b, 20)
    batched = T.forward_batch([(a[40:], cache_a), (b, seq_b), (c[10:], seq_c)], all_logits=True)  # [28, vocab]
    assert batched.shape == (1 + 20 + 7, smollm2.config.vocab_size)
    assert cache_a.length == 41 and seq_b.length == 20 and seq_c.length == 17

    alone = []
    for prefix, chunk in ((a[:40], a[40:]), ([], b), (c[:10], c[10:])):
        cache = KVCache.for_model(smollm2.config, 64)
        if len(prefix):
            T.forward(prefix, cache)
        alone.append(T.forward(chunk, cache))
    np.testing.assert_allclose(batched, np.concatenate(alone), atol=1e-4, rtol=0)
    reference = np.concatenate([hf_logits(hf_smollm2, a)[40:], hf_logits(hf_smollm2, b), hf_logits(hf_smollm2, c)[10:]])
    assert np.abs(batched - reference).max() < 1e-4
    two = [(a[:1], KVCache.for_model(smollm2.config, 4)), (b[:3], KVCache.for_model(smollm2.config, 4))]
    assert T.forward_batch(two).shape == (2, smollm2.config.vocab_size)  # default: each sequence's last row


def test_eight_prompts_batched_equal_eight_separate_generate_calls(smollm2):
    """8 prompts of 3 to 300 tokens, different max_new_tokens, greedy, one generate_batch with a
    128-token budget per step (the 300-token prompt is prefilled over 3 steps while others decode):
    exactly the ids, text and stop reason of 8 separate generate calls."""
    lengths = [3, 300, 17, 64, 150, 41, 230, 8]
    budgets = [12, 9, 20, 5, 16, 24, 7, 18]
    prompts = prompts_of(smollm2, lengths)
    tracer = minillm.Tracer()
    batched = minillm.generate_batch(smollm2, prompts, max_new_tokens=budgets, max_batched_tokens=128, tracer=tracer)
    for prompt, n, budget, got in zip(prompts, lengths, budgets, batched, strict=True):
        alone = minillm.generate(smollm2, prompt, max_new_tokens=budget)
        assert len(got.prompt_ids) == n
        assert got.ids == alone.ids, (n, got.text, alone.text)
        assert got.text == alone.text and got.stop_reason == alone.stop_reason
    steps = [e.data for e in tracer.events if e.phase == "batch_step"]
    assert all(s["tokens"] <= 128 for s in steps)
    # chunked prefill: while the 300-token prompt (request 1) is prefilled, request 0 decodes each step
    chunks = [s for s in steps if any(r["request"] == 1 and r["kind"] == "prefill" for r in s["rows"])]
    assert len(chunks) >= 3
    assert all(any(r["request"] == 0 and r["kind"] == "decode" for r in s["rows"]) for s in chunks[1:])


def test_a_pool_too_small_preempts_and_every_request_still_gets_its_own_tokens(smollm2):
    """6 prompts of 20-45 tokens, 40 new tokens each, in a pool of 12 blocks of 16 positions
    (12 * 16 * 46,080 bytes = 8.4375 MiB): they cannot all grow to 60-85 positions (4-6 blocks
    each) at once, so the newest are preempted and recomputed; every result equals generate alone.
    The trace shows the preemptions and the block tables."""
    prompts = prompts_of(smollm2, [20, 33, 45, 27, 38, 24])
    tracer = minillm.Tracer()
    mib = 12 * 16 * 46_080 / 2**20
    results = minillm.generate_batch(smollm2, prompts, max_new_tokens=40, kv_cache_mib=mib, tracer=tracer)
    assert sum(r.metrics.preemptions for r in results) > 0
    for prompt, got in zip(prompts, results, strict=True):
        alone = minillm.generate(smollm2, prompt, max_new_tokens=40)
        assert got.ids == alone.ids and got.text == alone.text
    steps = [e.data for e in tracer.events if e.phase == "batch_step"]
    assert all(s["blocks_total"] == 12 and s["blocks_used"] <= 12 for s in steps)
    preempting = [s for s in steps if s["preempted"]]
    assert preempting and any(r["recompute"] for s in steps for r in s["rows"])
    console = Console(record=True, width=160)
    printer = minillm.Tracer(console, verbosity="steps")
    for e in tracer.events:
        printer.emit(e.phase, e.start, e.duration, **e.data)
    shown = console.export_text()
    assert "preempted" in shown and "req 0 |" in shown


def test_admission_with_64_mib_admits_the_computed_number_of_512_token_requests(smollm2):
    """64 MiB on SmolLM2 = 91 blocks of 16 (test_paged_kv_cache). A 512-token prompt with 8 new
    tokens needs 512 + 8 - 1 = 519 positions = 33 blocks; 91 // 33 = 2 requests at once. Admission
    reserves the prompt's 32 blocks: a third needs 32 free of the 91 - 2 * 33 = 25 left: it waits."""
    prompts = [" a" * 512, " b" * 512, " c" * 512]  # distinct from the first token: no shared prefix
    assert [len(minillm.tokenize(smollm2, p)) for p in prompts] == [512] * 3
    tracer = minillm.Tracer()
    results = minillm.generate_batch(
        smollm2, prompts, max_new_tokens=8, kv_cache_mib=64, max_batched_tokens=512, tracer=tracer
    )
    steps = [e.data for e in tracer.events if e.phase == "batch_step"]
    assert steps[0]["blocks_total"] == 91
    assert max(len(s["tables"]) for s in steps) == 91 // 33 == 2
    assert any(len(s["tables"]) == 2 and s["waiting"] == [2] for s in steps)
    assert [r.metrics.new_tokens for r in results] == [8, 8, 8]


def test_a_shared_256_token_prefix_is_reused_and_cuts_ttft(smollm2):
    """A 256-token system text (16 whole blocks) then a question. The second request, on the same
    pool, reports 256 cached prompt tokens, prefills only its own 12 and gets its first token at
    least 3x sooner (medians of 3 rounds, asserted when the cores were ours); its ids equal
    generate alone."""
    system = "Facts: " + " a" * 251 + ".\n"
    assert len(minillm.tokenize(smollm2, system)) == 256
    first, second = system + "Q: What is two plus two?\nA:", system + "Q: Name a colour of the sky.\nA:"
    assert (minillm.tokenize(smollm2, second)[:256] == minillm.tokenize(smollm2, system)).all()
    minillm.generate_batch(
        smollm2, [system + "warm-up"], max_new_tokens=1, pool=KVCachePool.for_model(smollm2.config, 16)
    )
    cpu_before = cpu_snapshot()
    uncached, cached = [], []
    for _ in range(3):  # three rounds, each on a fresh pool, in turns: the medians are compared
        pool = KVCachePool.for_model(smollm2.config, kv_cache_mib=64)
        (a,) = minillm.generate_batch(smollm2, [first], max_new_tokens=4, pool=pool)
        (b,) = minillm.generate_batch(smollm2, [second], max_new_tokens=4, pool=pool)
        assert a.metrics.cached_prompt_tokens == 0 and b.metrics.cached_prompt_tokens == 256
        uncached.append(a.metrics.ttft_s)
        cached.append(b.metrics.ttft_s)
    busy = others_cpu_share(cpu_before, cpu_snapshot()) * (os.cpu_count() or 1) >= 0.5
    assert b.ids == minillm.generate(smollm2, second, max_new_tokens=4).ids
    if not busy:  # seconds are the model's own only when the cores were ours
        assert statistics.median(uncached) >= 3 * statistics.median(cached), (uncached, cached)


def test_sampled_requests_with_their_own_params_and_stops(smollm2):
    """Per-prompt params (seeded sampling and greedy) and per-prompt stops give what generate
    gives with the same arguments."""
    prompts = prompts_of(smollm2, [12, 30])
    params = [minillm.SamplingParams(temperature=0.8, top_k=40, seed=7), None]
    per_prompt = [{}, {"stop": ["."]}]
    got = minillm.generate_batch(smollm2, prompts, params, max_new_tokens=[10, 30], per_prompt=per_prompt)
    want = [
        minillm.generate(smollm2, prompts[0], params[0], max_new_tokens=10),
        minillm.generate(smollm2, prompts[1], max_new_tokens=30, stop=["."]),
    ]
    assert [g.ids for g in got] == [w.ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert got[1].stop_reason == want[1].stop_reason


# --- bad input ---------------------------------------------------------------------------------
def test_the_default_pool_is_sized_from_the_prompts_each_tokenized_once(smollm2, monkeypatch):
    """With no pool given, generate_batch tokenizes each prompt once (the request takes its ids as
    ``prepared``) and sizes the pool from them before any request or sequence exists."""
    prompts = prompts_of(smollm2, [40, 9])
    encoded, encode = [], smollm2.tokenizer.encode
    monkeypatch.setattr(smollm2.tokenizer, "encode", lambda text, **kw: encoded.append(text) or encode(text, **kw))
    tracer = minillm.Tracer()
    results = minillm.generate_batch(smollm2, prompts, max_new_tokens=[8, 4], block_size=16, tracer=tracer)
    assert encoded == prompts
    assert [len(r.prompt_ids) for r in results] == [40, 9] and [len(r.ids) for r in results] == [8, 4]
    # 40 + 8 - 1 = 47 positions = 3 blocks of 16; 9 + 4 - 1 = 12 positions = 1 block: 4 in all
    assert {e.data["blocks_total"] for e in tracer.events if e.phase == "batch_step"} == {4}


def test_bad_batches_get_clear_errors_before_any_model_work(smollm2, monkeypatch):
    calls = []
    monkeypatch.setattr(smollm2.transformer, "forward_batch", lambda *a, **k: calls.append(1))
    gb = minillm.generate_batch
    with pytest.raises(InvalidRequestError, match="empty list of prompts; pass at least one"):
        gb(smollm2, [])
    with pytest.raises(InvalidRequestError, match="takes a list of prompts, got str"):
        gb(smollm2, "Hello")
    with pytest.raises(InvalidRequestError, match="max_new_tokens is a list of 3 but there are 2 prompts"):
        gb(smollm2, ["a", "b"], max_new_tokens=[1, 2, 3])
    with pytest.raises(InvalidRequestError, match="params is a list of 1 but there are 2 prompts"):
        gb(smollm2, ["a", "b"], [minillm.SamplingParams()])
    with pytest.raises(InvalidRequestError, match="per_prompt is a list of 3 but there are 2 prompts"):
        gb(smollm2, ["a", "b"], per_prompt=[{}, {}, {}])
    with pytest.raises(InvalidRequestError, match="block_size must be a whole number of positions >= 1, got 0"):
        gb(smollm2, ["a"], block_size=0)
    with pytest.raises(InvalidRequestError, match="max_batched_tokens must be a whole number >= 1, got 0"):
        gb(smollm2, ["a"], max_batched_tokens=0)
    with pytest.raises(InvalidRequestError, match=r"0.5 MiB holds no block.*kv_cache_mib >= 0.703"):
        gb(smollm2, ["a"], kv_cache_mib=0.5)
    with pytest.raises(InvalidRequestError, match=r"unknown request option\(s\) \['cache'\]"):
        gb(smollm2, ["a"], cache=KVCache.for_model(smollm2.config, 8))
    # 1 MiB = 1 block of 16 positions (737,280 bytes): a 40-token prompt + 8 new tokens needs
    # 47 positions = 3 blocks; refused at admission, never left waiting
    prompt = prompts_of(smollm2, [40])[0]
    with pytest.raises(KVCachePoolTooSmall, match=r"request 1: .*40 tokens .* 47 positions = 3 blocks of 16.*holds 1"):
        gb(smollm2, ["Hi", prompt], max_new_tokens=8, kv_cache_mib=1)
    assert calls == []


# --- the benchmark's arithmetic ------------------------------------------------------------------
def test_batching_benchmark_bounds_by_hand_and_a_quick_run(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed
    from benchmarks import batching

    # 8 rows, 500 MB of weights, 125 M parameters, 46,080 bytes per position at context 100, 50 GB/s,
    # 100 GFLOP/s: memory (500e6 + 8 * 100 * 46,080) / 50e9 = 10.737 ms; compute 2 * 125e6 * 8 / 1e11
    # = 20 ms; the ceiling is 8 rows / 20 ms = 400 tokens/s (compute-bound).
    b = batching.step_bounds(8, 500_000_000, 125_000_000, 46_080, 100, 50e9, 100e9)
    assert b["memory_s"] == pytest.approx(0.01073728) and b["compute_s"] == pytest.approx(0.02)
    assert b["ceiling_tokens_s"] == pytest.approx(400.0)
    report = batching.main(["--quick", "--json", str(tmp_path / "b.json")])
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    assert (tmp_path / "b.json").exists() and report["rows"][0]["tokens_s"] > 0
