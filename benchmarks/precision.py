"""What precision costs, measured: memory, speed and quality of each weight_dtype (and KV dtype).

    python -m benchmarks.precision                       # SmolLM2 and Gemma 3 270M, every precision
    python -m benchmarks.precision --models smollm2-135m-instruct --dtypes float32 int8 --decode 16

For each model and ``weight_dtype`` (float32, bfloat16, int8, gguf):
- resident bytes: the RSS growth of a fresh process while it loads the weights (no tokenizer),
  against the table (``Weights.nbytes``, from the formats actually held);
- speed: prefill tokens/s (a 128-token prompt) and decode tokens/s (median step);
- quality against float32 over ``examples/evaluation_text.txt`` (>= 2,000 tokens): max |Δ logit|,
  mean KL(p_float32 || p), and perplexity; greedy continuations of 5 prompts, first differing token.

Results go to ``benchmarks/results/local/precision.json`` (untracked) unless ``--json`` says otherwise.
BLAS runs on one thread (threadpoolctl) so the numbers do not depend on a neighbour's load as much.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "local" / "precision.json"
EVAL_TEXT = ROOT / "examples" / "evaluation_text.txt"
MODELS = ("smollm2-135m-instruct", "gemma3-270m")
DTYPES = ("float32", "bfloat16", "int8", "gguf")
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
)
CHUNK = 128  # positions per forward when scoring a long text: Gemma's logits are 1 MiB per position


def rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc/self/statm``), in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def weights_resident(name: str, weight_dtype: str) -> dict:
    """In this process: RSS growth while reading ``name``'s weights at ``weight_dtype`` (call it in a
    fresh process: :func:`measure_resident`). Returns ``{"rss_delta", "table", "formats"}``."""
    from minillm.model.config import ModelConfig
    from minillm.model.gguf_weights import load_gguf_weights
    from minillm.model.weights import hold_weights, load_weights
    from minillm.sources.hub import resolve_gguf, resolve_model

    folder = resolve_model(name, progress=False).path
    config = ModelConfig.from_folder(folder)
    gguf = resolve_gguf(name, progress=False) if weight_dtype == "gguf" else None
    import gguf as _gguf  # noqa: F401  the libraries' own import costs are not the weights'
    import ml_dtypes  # noqa: F401
    import safetensors.numpy  # noqa: F401

    gc.collect()
    before = rss_bytes()
    if gguf is not None:
        weights = load_gguf_weights(gguf, config)
    else:
        weights = hold_weights(load_weights(folder, config), weight_dtype)
    gc.collect()
    after = rss_bytes()
    return {"rss_delta": after - before, "table": weights.nbytes, "formats": weights.formats()}


def measure_resident(name: str, weight_dtype: str) -> dict:
    """:func:`weights_resident` in a fresh Python process (so nothing loaded before counts)."""
    code = (
        "import json, sys; from benchmarks.precision import weights_resident; "
        f"print(json.dumps(weights_resident({name!r}, {weight_dtype!r})))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def chunked_logits(model, ids: np.ndarray, kv_dtype: str = "float32"):
    """Yield ``(start, logits [n, vocab])`` for every position of ``ids``, ``CHUNK`` positions per forward."""
    import minillm

    cache = minillm.KVCache.for_model(model.config, max_seq_len=len(ids), dtype=kv_dtype)
    for start in range(0, len(ids), CHUNK):
        yield start, model.transformer.forward(ids[start : start + CHUNK], cache)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``[n, vocab]`` -> log-probabilities, in float64 (so KL of nearly equal rows is not rounding noise)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_over_text(model, reference, ids: np.ndarray, kv_dtype: str = "float32") -> dict:
    """Quality of ``model`` against ``reference`` (same tokenizer) over ``ids``: perplexity of each,
    max |Δ logit| and mean KL(p_reference || p_model) over every position."""
    nll, nll_ref, kl, max_diff = [], [], [], 0.0
    pairs = zip(chunked_logits(model, ids, kv_dtype), chunked_logits(reference, ids), strict=True)
    for (start, lg), (_, ref) in pairs:
        lp, lp_ref = log_softmax(lg), log_softmax(ref)
        targets = ids[start + 1 : start + 1 + len(lg)]  # the next token of each position (none after the last)
        rows = np.arange(len(targets))
        nll.extend(-lp[rows, targets])
        nll_ref.extend(-lp_ref[rows, targets])
        kl.extend((np.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1))
        max_diff = max(max_diff, float(np.abs(lg - ref).max()))
    return {
        "tokens": int(len(ids)),
        "perplexity": float(np.exp(np.mean(nll))),
        "perplexity_reference": float(np.exp(np.mean(nll_ref))),
        "max_abs_logit_diff": max_diff,
        "mean_kl": float(np.mean(kl)),
    }


def greedy(model, prompt: str, n: int = 32) -> list[int]:
    """The ``n`` greedy (argmax) tokens after ``prompt``."""
    import minillm

    ids = minillm.tokenize(model, prompt)
    cache = minillm.KVCache.for_model(model.config, max_seq_len=len(ids) + n)
    logits, out = minillm.prefill(model, ids, cache), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = minillm.decode_step(model, out[-1], cache)
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ; None if they agree throughout."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def speed(model, decode_steps: int = 16, prompt_tokens: int = 128) -> dict:
    """Prefill tokens/s of a ``prompt_tokens`` prompt, and decode tokens/s (median of the steps)."""
    import minillm

    ids = minillm.tokenize(model, EVAL_TEXT.read_text(encoding="utf-8"))[:prompt_tokens]
    cache = minillm.KVCache.for_model(model.config, max_seq_len=prompt_tokens + decode_steps)
    t = time.perf_counter()
    logits = minillm.prefill(model, ids, cache)
    prefill_s = time.perf_counter() - t
    steps = []
    for _ in range(decode_steps):
        t = time.perf_counter()
        logits = minillm.decode_step(model, int(logits.argmax()), cache)
        steps.append(time.perf_counter() - t)
    return {"prefill_tokens_per_s": prompt_tokens / prefill_s, "decode_tokens_per_s": 1 / statistics.median(steps)}


def run(models, dtypes, decode_steps: int, greedy_tokens: int, eval_tokens: int | None) -> dict:
    import minillm

    results: dict = {"models": {}}
    text = EVAL_TEXT.read_text(encoding="utf-8")
    for name in models:
        reference = minillm.load(name, progress=False, warmup=False)
        ids = minillm.tokenize(reference, text)[:eval_tokens]
        ref_greedy = [greedy(reference, p, greedy_tokens) for p in PROMPTS]
        rows = {}
        for dtype in dtypes:
            print(f"{name} {dtype} ...", file=sys.stderr, flush=True)
            model = reference if dtype == "float32" else minillm.load(name, weight_dtype=dtype, progress=False)
            row = {"resident": measure_resident(name, dtype), **speed(model, decode_steps)}
            row["bits_per_weight"] = 8 * row["resident"]["table"] / model.transformer.weights.num_parameters
            row["quality"] = compare_over_text(model, reference, ids)
            continuations = ref_greedy if dtype == "float32" else [greedy(model, p, greedy_tokens) for p in PROMPTS]
            row["greedy_first_difference"] = [first_difference(a, b) for a, b in zip(continuations, ref_greedy)]
            rows[dtype] = row
            print(json.dumps({k: v for k, v in row.items() if k != "resident"}, default=str), file=sys.stderr)
            if model is not reference:
                del model
                gc.collect()
        kv = {}
        for kv_dtype in ("float16", "int8"):
            q = compare_over_text(reference, reference, ids[:512], kv_dtype=kv_dtype)
            cache = minillm.KVCache.for_model(reference.config, max_seq_len=1, dtype=kv_dtype)
            kv[kv_dtype] = {"bytes_per_token": cache.bytes_per_token, **q}
        results["models"][name] = {"weights": rows, "kv_cache": kv, "eval_tokens": int(len(ids))}
        del reference
        gc.collect()
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed per precision")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens per prompt compared with float32")
    ap.add_argument("--eval-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        results = run(args.models, args.dtypes, args.decode, args.greedy, args.eval_tokens)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
