"""Bit-identity reference of the forward pass: logits of fixed inputs, saved for a later checkout.

    python -m benchmarks.ab_kernels --out /tmp/logits-before.npz           # save
    python -m benchmarks.ab_kernels --out /tmp/after.npz --against /tmp/logits-before.npz

In a fresh process: loads SmolLM2, runs 3 fixed prompts through a prefill and 8 greedy decode
steps (``minillm.prefill`` / ``minillm.decode_step`` on a ``KVCache``), batched decode steps of
1, 8 and 32 rows through the paged pool (``Transformer.forward_batch``, as lesson 11 builds them)
and one prefill of 600 tokens, and writes every logits array (float32) to an ``.npz``, with the
sha256 of each printed. ``--against`` compares with a saved file, array by array, bit for bit.
``--kernels`` is passed to ``minillm.load`` when given (a checkout without the choice takes none).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)
DECODE_STEPS = 8
BATCHES = (1, 8, 32)
PREFILL_TOKENS = 600


def sequence_logits(minillm, model) -> dict[str, np.ndarray]:
    """Prefill + ``DECODE_STEPS`` greedy decode steps per prompt: ``{"p{i}.s{j}": logits [vocab]}``."""
    out = {}
    for i, prompt in enumerate(PROMPTS):
        ids = minillm.tokenize(model, prompt)
        cache = minillm.KVCache.for_model(model.config, max_seq_len=len(ids) + DECODE_STEPS + 1)
        logits = minillm.prefill(model, ids, cache)
        out[f"p{i}.s0"] = np.asarray(logits, dtype=np.float32)
        for j in range(1, DECODE_STEPS + 1):
            logits = minillm.decode_step(model, int(np.argmax(logits)), cache)
            out[f"p{i}.s{j}"] = np.asarray(logits, dtype=np.float32)
    return out


def batch_logits(minillm, model, batch: int, prompt_tokens: int = 40, steps: int = 2) -> dict[str, np.ndarray]:
    """``steps`` batched decode steps of ``batch`` rows over a paged pool (rows at different
    positions: prompt lengths ``prompt_tokens + r``): ``{"b{batch}.s{j}": logits [batch, vocab]}``."""
    from minillm.model.paged_kv_cache import KVCachePool

    cfg, transformer = model.config, model.transformer
    longest = prompt_tokens + batch + steps + 1
    pool = KVCachePool.for_model(cfg, kv_cache_mib=batch * (longest // 16 + 2) * 16 * cfg.kv_bytes_per_token() / 2**20)
    rng = np.random.default_rng(batch)
    seqs = []
    for r in range(batch):
        seq = pool.sequence(longest)
        pool.grow(seq, prompt_tokens + r)
        transformer.forward(rng.integers(0, cfg.vocab_size, prompt_tokens + r), seq, last_only=True)
        seqs.append(seq)
    out, tokens = {}, [7 + r for r in range(batch)]
    for j in range(steps):
        for seq in seqs:
            pool.grow(seq, 1)
        logits = transformer.forward_batch([(np.array([t]), seq) for t, seq in zip(tokens, seqs, strict=True)])
        out[f"b{batch}.s{j}"] = np.asarray(logits, dtype=np.float32)
        tokens = [int(t) for t in np.argmax(logits, axis=-1)]
    return out


def prefill_logits(minillm, model) -> dict[str, np.ndarray]:
    """All ``PREFILL_TOKENS`` rows of one prefill's logits ``[600, vocab]`` (a long, chunked prefill)."""
    ids = np.arange(300, 300 + PREFILL_TOKENS) % model.config.vocab_size
    cache = minillm.KVCache.for_model(model.config, max_seq_len=PREFILL_TOKENS)
    return {"prefill600": np.asarray(model.transformer.forward(ids, cache), dtype=np.float32)}


def collect(kernels: str | None) -> dict[str, np.ndarray]:
    """Every logits array of this checkout's ``minillm`` (imported from ``sys.path``)."""
    import minillm

    extra = {} if kernels is None else {"kernels": kernels}
    model = minillm.load("smollm2-135m-instruct", progress=False, **extra)
    out = sequence_logits(minillm, model)
    for b in BATCHES:
        out.update(batch_logits(minillm, model, b))
    out.update(prefill_logits(minillm, model))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the .npz to write")
    parser.add_argument("--against", type=Path, help="a saved .npz to compare with, bit for bit")
    parser.add_argument("--kernels", choices=("plain", "tuned"), help="passed to minillm.load")
    args = parser.parse_args(argv)
    import minillm

    print(f"minillm from {Path(minillm.__file__).parent}")
    arrays = collect(args.kernels)
    np.savez(args.out, **arrays)
    for name, a in arrays.items():
        print(f"{name:12s} {str(a.shape):14s} {hashlib.sha256(a.tobytes()).hexdigest()[:16]}")
    if args.against is None:
        return 0
    saved = np.load(args.against)
    differ = [n for n in saved.files if n not in arrays or saved[n].tobytes() != arrays[n].tobytes()]
    for n in differ:
        if n in arrays:
            print(f"DIFFERS {n}: max |diff| {np.max(np.abs(saved[n] - arrays[n])):.3g}")
        else:
            print(f"MISSING {n}")
    print(f"{len(saved.files) - len(differ)}/{len(saved.files)} arrays bit-identical to {args.against}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
