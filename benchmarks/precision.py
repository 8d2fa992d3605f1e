"""What precision costs, measured: memory, speed and quality of each weight_dtype (and KV dtype).

    python -m benchmarks.precision                       # SmolLM2 and Gemma 3 270M, every precision
    python -m benchmarks.precision --models smollm2-135m-instruct --dtypes float32 int8 --decode 16

For each model and ``weight_dtype`` (float32, bfloat16, int8, gguf):
- resident bytes: the RSS growth of a fresh process while it loads the weights (no tokenizer),
  against the table (``Weights.nbytes``, from the formats actually held);
- speed: prefill tokens/s (a 128-token prompt) and decode tokens/s (median step), with the share
  of the cores other processes used meanwhile (a number far from 0: the machine was shared);
- quality against float32 over ``examples/evaluation_text.txt`` (>= 2,000 tokens): max |Δ logit|
  (and its median over positions), mean KL(p_float32 || p), and perplexity; greedy continuations
  of 5 prompts, the first differing token and float32's own top-2 logit margin there;
- the KV cache at float16 and int8 (weights float32): bytes per token and at full context, speed,
  the same quality columns;
- llama.cpp (its server engine, prebuilt in the wheel ``xllamacpp``) on the same GGUF file: prefill and
  decode tokens/s with the same thread count, its dequantization fused into its dot products.

Results go to ``benchmarks/results/local/precision.json`` (untracked) unless ``--json`` says otherwise.
BLAS runs on one thread (threadpoolctl), llama.cpp too (``n_threads=1``), so the numbers do not
depend on a neighbour's load as much and the two runtimes get the same cores.
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
KV_DTYPES = ("float32", "float16", "int8")
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
)
CHUNK = 128  # positions per forward when scoring a long text, at most (see chunk_positions)
CHUNK_LOGIT_BYTES = 32 << 20  # and at most 32 MiB of float32 logits: Gemma's vocabulary is 262,144 wide


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
    step = chunk_positions(model.config.vocab_size)
    for start in range(0, len(ids), step):
        yield start, model.transformer.forward(ids[start : start + step], cache)


def chunk_positions(vocab_size: int) -> int:
    """Positions per forward when scoring: ``CHUNK``, fewer where a chunk's float32 logits would pass
    ``CHUNK_LOGIT_BYTES`` (the scoring holds several float64 copies of them): SmolLM2 128, Gemma 3 32."""
    return max(1, min(CHUNK, CHUNK_LOGIT_BYTES // (4 * vocab_size)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``[n, vocab]`` -> log-probabilities, in float64 (so KL of nearly equal rows is not rounding noise)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_over_text(model, reference, ids: np.ndarray, kv_dtype: str = "float32") -> dict:
    """Quality of ``model`` against ``reference`` (same tokenizer) over ``ids``: perplexity of each,
    max |Δ logit| (and the median over positions of each position's max), mean KL(p_reference || p_model)."""
    return compare_many({"model": (model, kv_dtype)}, reference, ids)["model"]


def compare_many(candidates: dict, reference, ids: np.ndarray) -> dict:
    """:func:`compare_over_text` for several ``{name: (model, kv_dtype)}`` in one pass over ``ids``:
    the reference's logits (float32 weights, float32 KV) are computed once per chunk, not once per
    candidate. Returns ``{name: {"tokens", "perplexity", "perplexity_reference", "max_abs_logit_diff",
    "median_max_abs_logit_diff", "mean_kl"}}``; perplexity is exp(mean negative log-likelihood of the
    next token), KL in nats, logit differences in logit units."""
    streams = {name: chunked_logits(m, ids, kv) for name, (m, kv) in candidates.items()}
    nll_ref: list = []
    acc = {name: {"nll": [], "kl": [], "pos_max": []} for name in candidates}
    for start, ref in chunked_logits(reference, ids):
        lp_ref = log_softmax(ref)
        targets = ids[start + 1 : start + 1 + len(ref)]  # the next token of each position (none after the last)
        rows = np.arange(len(targets))
        nll_ref.extend(-lp_ref[rows, targets])
        p_ref = np.exp(lp_ref)
        for name, stream in streams.items():
            _, lg = next(stream)
            lp = log_softmax(lg)
            a = acc[name]
            a["nll"].extend(-lp[rows, targets])
            a["kl"].extend((p_ref * (lp_ref - lp)).sum(axis=-1))
            a["pos_max"].extend(np.abs(lg - ref).max(axis=-1))
    out = {}
    for name, a in acc.items():
        out[name] = {
            "tokens": int(len(ids)),
            "perplexity": float(np.exp(np.mean(a["nll"]))),
            "perplexity_reference": float(np.exp(np.mean(nll_ref))),
            "max_abs_logit_diff": float(np.max(a["pos_max"])),
            "median_max_abs_logit_diff": float(np.median(a["pos_max"])),
            "mean_kl": float(np.mean(a["kl"])),
        }
    return out


def greedy(model, prompt: str, n: int = 32, kv_dtype: str = "float32", margins: list | None = None) -> list[int]:
    """The ``n`` greedy (argmax) tokens after ``prompt``; if ``margins`` is a list, each step's top-2
    logit margin (largest minus second largest) is appended to it."""
    import minillm

    ids = minillm.tokenize(model, prompt)
    cache = minillm.KVCache.for_model(model.config, max_seq_len=len(ids) + n, dtype=kv_dtype)
    logits, out = minillm.prefill(model, ids, cache), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        if margins is not None:
            top2 = np.partition(logits, -2)[-2:]
            margins.append(float(top2.max() - top2.min()))
        logits = minillm.decode_step(model, out[-1], cache)
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ; None if they agree throughout."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def greedy_against(model, prompts, reference_runs: list[tuple[list[int], list[float]]], n: int, kv_dtype="float32"):
    """For each prompt: the first token where ``model``'s greedy run leaves float32's, and float32's
    top-2 margin at that token (None, None where they agree). ``reference_runs``: (ids, margins) of
    float32 per prompt, from :func:`greedy`."""
    rows = []
    for prompt, (ref_ids, ref_margins) in zip(prompts, reference_runs, strict=True):
        d = first_difference(greedy(model, prompt, n, kv_dtype), ref_ids)
        rows.append({"first_difference": d, "reference_margin": None if d is None else ref_margins[d]})
    return rows


def speed(model, decode_steps: int = 16, prompt_tokens: int = 128, kv_dtype: str = "float32") -> dict:
    """Prefill tokens/s of a ``prompt_tokens`` prompt (the evaluation text's first tokens), decode
    tokens/s (1 / median step of ``decode_steps``), and ``others_cpu_share``: the share (0..1) of
    all cores other processes used meanwhile (``observe.metrics``)."""
    import minillm
    from minillm.observe.metrics import cpu_snapshot, others_cpu_share

    ids = minillm.tokenize(model, EVAL_TEXT.read_text(encoding="utf-8"))[:prompt_tokens]
    cache = minillm.KVCache.for_model(model.config, max_seq_len=prompt_tokens + decode_steps + 1, dtype=kv_dtype)
    minillm.decode_step(model, int(ids[0]), cache)  # one step first: the first product pays one-time costs
    cache.reset()
    before = cpu_snapshot()
    t = time.perf_counter()
    logits = minillm.prefill(model, ids, cache)
    prefill_s = time.perf_counter() - t
    steps = []
    for _ in range(decode_steps):
        t = time.perf_counter()
        logits = minillm.decode_step(model, int(logits.argmax()), cache)
        steps.append(time.perf_counter() - t)
    return {
        "prefill_tokens_per_s": prompt_tokens / prefill_s,
        "decode_tokens_per_s": 1 / statistics.median(steps),
        "others_cpu_share": others_cpu_share(before, cpu_snapshot()),
    }


def llama_cpp_speed(gguf_path, decode_steps: int = 16, prompt_tokens: int = 128, threads: int = 1) -> dict:
    """llama.cpp's own prefill and decode tokens/s on a GGUF file (its server engine, in process, from
    the prebuilt wheel ``xllamacpp``), measured as :func:`speed` measures minillm: the evaluation
    text's first ``prompt_tokens`` tokens (llama.cpp's tokenizer) in one batch, then
    ``decode_steps`` steps of one token each on the cached prompt (1 / median). The times are
    llama.cpp's own (each request's ``timings.prompt_ms``: its batch's evaluation, no HTTP or JSON).

    Its matrix products read the packed blocks directly (ggml's ``vec_dot_q4_1_q8_1`` and kin: the
    activations are quantized to 8 bits, and the dot product runs on the integers block by block),
    so no float32 copy of a weight is ever written. ``threads``: its compute threads (batch too).

    Raises:
        RuntimeError: a request evaluated another number of tokens than the step asked for (its
            prompt cache was not reused as expected), so its time would not be a decode step's.
    """
    import urllib.request

    import xllamacpp

    from minillm.observe.metrics import cpu_snapshot, others_cpu_share

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf_path)
    params.n_ctx = prompt_tokens + decode_steps + 8
    params.n_batch = prompt_tokens
    params.n_parallel = 1  # one slot: every request below extends the same cached sequence
    params.swa_full = True  # sliding-window layers (Gemma 3) keep every position: the whole prompt stays reusable
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.verbosity = -1  # its log goes to the process's stderr (a lesson's output otherwise)
    server = xllamacpp.Server(params)
    tokenize = urllib.request.Request(
        server.listening_address + "/tokenize",
        data=json.dumps({"content": EVAL_TEXT.read_text(encoding="utf-8")}).encode("utf-8"),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(tokenize, timeout=60) as r:
        ids = json.load(r)["tokens"][:prompt_tokens]

    def evaluate(tokens: list[int], new: int, cache: bool = True) -> float:
        """Seconds llama.cpp spent evaluating the ``new`` tokens at the end of ``tokens``."""
        answer = server.handle_completions({"prompt": tokens, "max_tokens": 1, "temperature": 0, "cache_prompt": cache})
        timings = answer["timings"]
        if timings["prompt_n"] != new:
            raise RuntimeError(f"llama.cpp evaluated {timings['prompt_n']} tokens, not {new}: {timings}")
        return timings["prompt_ms"] / 1000

    evaluate(ids[:8], 8, cache=False)  # warm-up: its first call pays one-time costs, as minillm's does
    before = cpu_snapshot()
    prefill_s = evaluate(ids, prompt_tokens, cache=False)
    steps = [evaluate(ids + ids[: i + 1], 1) for i in range(decode_steps)]  # the cache reused: a decode step
    share = others_cpu_share(before, cpu_snapshot())
    server = None  # its destructor stops the HTTP threads and frees the model
    return {
        "prefill_tokens_per_s": prompt_tokens / prefill_s,
        "decode_tokens_per_s": 1 / statistics.median(steps),
        "threads": threads,
        "version": xllamacpp.__version__,
        "others_cpu_share": share,
    }


def run(models, dtypes, decode_steps: int, greedy_tokens: int, eval_tokens: int | None, kv_dtypes=KV_DTYPES) -> dict:
    import minillm
    from minillm.sources.hub import resolve_gguf

    results: dict = {"models": {}, "blas_threads": 1, "llama_cpp_threads": 1}
    text = EVAL_TEXT.read_text(encoding="utf-8")
    for name in models:
        reference = minillm.load(name, progress=False, warmup=False)
        ids = minillm.tokenize(reference, text)[:eval_tokens]
        ref_runs = []
        for p in PROMPTS:
            margins: list = []
            ref_runs.append((greedy(reference, p, greedy_tokens, margins=margins), margins))
        rows, held = {}, {}
        for dtype in dtypes:
            print(f"{name} {dtype} ...", file=sys.stderr, flush=True)
            model = reference if dtype == "float32" else minillm.load(name, weight_dtype=dtype, progress=False)
            held[dtype] = model
            row = {"resident": measure_resident(name, dtype), **speed(model, decode_steps)}
            row["bits_per_weight"] = 8 * row["resident"]["table"] / model.transformer.weights.num_parameters
            row["greedy"] = greedy_against(model, PROMPTS, ref_runs, greedy_tokens)
            rows[dtype] = row
        kv = {}
        for kv_dtype in kv_dtypes:
            print(f"{name} KV {kv_dtype} ...", file=sys.stderr, flush=True)
            cache = minillm.KVCache.for_model(reference.config, max_seq_len=1, dtype=kv_dtype)
            kv[kv_dtype] = {
                "bytes_per_token": cache.bytes_per_token,
                "bytes_full_context": cache.bytes_per_token * reference.config.max_position_embeddings,
                **speed(reference, decode_steps, kv_dtype=kv_dtype),
                "greedy": greedy_against(reference, PROMPTS, ref_runs, greedy_tokens, kv_dtype),
            }
        print(f"{name} quality over {len(ids)} tokens ...", file=sys.stderr, flush=True)
        candidates = {("weights", d): (m, "float32") for d, m in held.items()}
        candidates.update({("kv", d): (reference, d) for d in kv})
        quality = compare_many(candidates, reference, ids)
        for (kind, d), q in quality.items():
            (rows if kind == "weights" else kv)[d]["quality"] = q
        llama = llama_cpp_speed(resolve_gguf(name, progress=False), decode_steps)
        results["models"][name] = {
            "weights": rows,
            "kv_cache": kv,
            "llama_cpp": llama,
            "eval_tokens": int(len(ids)),
            "greedy_tokens": greedy_tokens,
            "reference_greedy_min_margin": [min(m) for _, m in ref_runs],
        }
        print(json.dumps(results["models"][name], default=str)[:2000], file=sys.stderr)
        del reference, held, candidates, model
        gc.collect()
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed per precision")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens per prompt compared with float32")
    ap.add_argument("--eval-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ap.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        results = run(args.models, args.dtypes, args.decode, args.greedy, args.eval_tokens, args.kv_dtypes)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
