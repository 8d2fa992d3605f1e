"""Small helpers shared by test modules (imported as ``from helpers import ...``; tests/ is on sys.path)."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_bench(url: str, model: str, out: Path, *, concurrency: str, requests: int, prompt_tokens: int,
              max_tokens: int) -> subprocess.CompletedProcess:
    """Run ``python -m minillm bench`` against ``url`` the way a user would (a subprocess, 160
    columns, results written as JSON to ``out``); return the finished process, output captured as text.
    The caller asserts on its return code: a failed bench is a test's finding, not an exception here."""
    cmd = [sys.executable, "-m", "minillm", "bench", "--url", url, "--model", model, "--concurrency", concurrency,
           "--requests", str(requests), "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens),
           "--json", str(out)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "COLUMNS": "160"})


def release_memory() -> None:
    """Collect dropped objects (cycles included) and hand the freed heap back to the system: glibc
    keeps freed small blocks otherwise, and the RSS budget (tests/rss_budget.py) counts them."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is still free for this process
        pass


def batched_decode_logits(model, batch: int, steps: int = 2) -> np.ndarray:
    """``steps`` batched decode steps of ``batch`` rows (rows at positions 40 + r) over a paged pool:
    logits ``[steps, batch, vocab]``, the rows' greedy ids fed back."""
    from minillm.model.paged_kv_cache import KVCachePool

    cfg = model.config
    pool = KVCachePool.for_model(cfg, kv_cache_mib=batch * 8 * 16 * cfg.kv_bytes_per_token() / 2**20)
    rng = np.random.default_rng(batch)
    seqs = [pool.sequence(40 + batch + steps + 1) for _ in range(batch)]
    for r, seq in enumerate(seqs):
        pool.grow(seq, 40 + r)
        model.forward(rng.integers(0, cfg.vocab_size, 40 + r), seq, last_only=True)
    out, tokens = [], [7 + r for r in range(batch)]
    for _ in range(steps):
        for seq in seqs:
            pool.grow(seq, 1)
        out.append(model.forward_batch([(np.array([t]), s) for t, s in zip(tokens, seqs, strict=True)]))
        tokens = [int(t) for t in np.argmax(out[-1], axis=-1)]
    return np.stack(out)
