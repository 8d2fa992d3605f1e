"""What one worker process measures: one runtime (minillm, torch eager, torch sdpa) or the machine.

``benchmarks/speed.py`` starts each worker as its own process, one after the other::

    python -m benchmarks.speed --worker minillm --worker-opts '{...}' --worker-out result.json

so that each runtime's peak RSS (``ru_maxrss``) is its own and one runtime's threads never share
the two cores with another's. A worker writes one JSON dict; every time is a list with one entry
per repeat (the parent takes medians), in seconds.

The figures, and what is timed:

- load: ``minillm.load(name)`` / ``AutoModelForCausalLM.from_pretrained(folder)``, from the cache
  (files already on disk; the import of the library is timed apart).
- prefill at length L: one forward pass over L prompt ids that fills the KV cache and gives the
  logits of the last position only (minillm ``prefill``; transformers ``model(ids,
  logits_to_keep=1)``, what ``generate`` itself does for the prompt).
- decode: 128 new tokens, greedy, from a 16-token prompt. Each runtime stamps the clock right
  after each forward pass (minillm in its own loop of ``decode_step`` + ``sample``; transformers
  inside ``generate`` through a logits processor), so ``decode tokens/s = (new_tokens - 1) /
  (last stamp - first stamp)``: the decode steps only, without the prefill.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


# --- about the process ---------------------------------------------------------------------------
def blas_info() -> list[dict]:
    """threadpoolctl's view of the native thread pools loaded in this process (BLAS, OpenMP)."""
    from threadpoolctl import threadpool_info

    keys = (
        "user_api",
        "internal_api",
        "prefix",
        "version",
        "architecture",
        "corename",
        "threading_layer",
        "num_threads",
        "filepath",
    )
    return [{k: pool[k] for k in keys if k in pool} for pool in threadpool_info()]


def peak_rss_bytes() -> int:
    """The process's resident-set high-water mark (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """The process's resident set now, from /proc/self/statm."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def process_facts() -> dict:
    """Threads, BLAS, OPENBLAS_* variables and load, as this worker saw them."""
    return {
        "pid": os.getpid(),
        "blas": blas_info(),
        "env": {name: os.environ.get(name) for name in OPENBLAS_VARS},
        "loadavg": list(os.getloadavg()),
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_bytes": rss_bytes(),
    }


def limit_threads(threads: int):
    """Set every native pool (NumPy's BLAS, OpenMP) to ``threads`` with threadpoolctl, not env vars.

    Returns the controller; the limits hold while it lives.
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=threads)


def prompt_ids(length: int, vocab: int, seed: int) -> np.ndarray:
    """A fixed pseudo-random prompt: ``[length]`` int64 ids, identical in every worker."""
    return np.random.default_rng(seed + length).integers(0, vocab, size=length, dtype=np.int64)


def timed(fn, repeats: int, warmup: int = 1, times_itself: bool = False) -> list[float]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times; each call's seconds.

    With ``times_itself``, ``fn`` returns its own measured seconds (to leave set-up out).
    """
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        own = fn()
        runs.append(own if times_itself else time.perf_counter() - t0)
    return runs


def log(msg: str) -> None:
    print(f"  [{os.getpid()}] {msg}", file=sys.stderr, flush=True)


# --- the machine ---------------------------------------------------------------------------------
def measure_machine(opts: dict) -> dict:
    """Memory bandwidth (large NumPy sum and copy, split over the cores) and float32 GEMM GFLOP/s.

    Bandwidth: ``bandwidth_bytes`` (1 GiB) float32 arrays, best of ``repeats``; "read" sums one
    array (bytes read / s), "copy" copies one into another (bytes read + bytes written / s), both
    split over ``threads`` Python threads (NumPy releases the GIL inside both loops); "gemv" is
    the same array as a ``[rows, 4096]`` matrix times a vector through BLAS (bytes read / s): the
    access pattern of a decode step. ``bandwidth_gb_s``, the figure the decode ceiling uses, is the
    best of the three: no loop can beat what the memory gives, so the fastest is the closest bound.
    GEMM: ``[n, n] @ [n, n]`` float32 through NumPy's BLAS, ``2 n^3`` FLOPs, best of ``repeats``.
    """
    threads, repeats = opts["threads"], opts["machine_repeats"]
    keep = limit_threads(threads)
    n = opts["bandwidth_bytes"] // 4

    def best(fn) -> float:
        return min(timed(fn, repeats, warmup=1))

    def bandwidth_seconds() -> tuple[float, float, float, float]:
        """read, copy, one-thread read and GEMV seconds; the 2 GiB of arrays are freed on return."""
        src = np.ones(n, dtype=np.float32)
        dst = np.zeros(n, dtype=np.float32)  # touched, so no page faults inside the timing
        src_parts, dst_parts = np.array_split(src, threads), np.array_split(dst, threads)
        with ThreadPoolExecutor(threads) as pool:
            read_s = best(lambda: list(pool.map(np.sum, src_parts)))
            copy_s = best(lambda: list(pool.map(np.copyto, dst_parts, src_parts)))
        matrix, vector = src.reshape(-1, 4096), np.ones(4096, dtype=np.float32)
        return read_s, copy_s, best(lambda: np.sum(src)), best(lambda: matrix @ vector)

    read_s, copy_s, read_1_s, gemv_s = bandwidth_seconds()

    g = opts["gemm_n"]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((g, g), dtype=np.float32)
    b = rng.standard_normal((g, g), dtype=np.float32)
    c = np.empty((g, g), dtype=np.float32)
    gemm_s = best(lambda: np.matmul(a, b, out=c))

    nbytes = n * 4
    rates = {
        "read_gb_s": nbytes / read_s / 1e9,
        "copy_gb_s": 2 * nbytes / copy_s / 1e9,
        "gemv_gb_s": nbytes / gemv_s / 1e9,
    }
    out = {
        "threads": threads,
        "bandwidth_bytes": nbytes,
        "bandwidth_gb_s": max(rates.values()),
        **rates,
        "read_1thread_gb_s": nbytes / read_1_s / 1e9,
        "gemm_n": g,
        "gemm_gflop_s": 2 * g**3 / gemm_s / 1e9,
        "numpy": np.__version__,
        **process_facts(),
    }
    del keep
    return out


# --- minillm -------------------------------------------------------------------------------------
def _minillm_load(opts: dict):
    t0 = time.perf_counter()
    import minillm

    t1 = time.perf_counter()
    model = minillm.load(opts["model"], progress=False, kernels=opts.get("kernels", "tuned"))
    t2 = time.perf_counter()
    return minillm, model, t1 - t0, t2 - t1


def minillm_decode(minillm, model, ids: np.ndarray, new_tokens: int) -> tuple[float, list[float], int]:
    """Prefill ``ids``, then greedy-decode until ``new_tokens`` exist. Returns (seconds for the
    ``new_tokens - 1`` decode steps, each step's seconds, the cache's bytes)."""
    cache = minillm.KVCache.for_model(model.config, max_seq_len=len(ids) + new_tokens)
    greedy = minillm.SamplingParams(temperature=0.0)
    logits = minillm.prefill(model, ids, cache)
    stamps = [time.perf_counter()]
    token = minillm.sample(logits, greedy)
    for _ in range(new_tokens - 1):
        logits = minillm.decode_step(model, token, cache)
        stamps.append(time.perf_counter())
        token = minillm.sample(logits, greedy)
    return stamps[-1] - stamps[0], list(np.diff(stamps)), cache.nbytes


def measure_minillm(opts: dict) -> dict:
    """minillm: warm load, prefill at each prompt length, decode, memory (``opts["kernels"]``:
    ``minillm.load``'s kernels, default ``"tuned"``)."""
    keep = limit_threads(opts["threads"])
    rss_start = rss_bytes()
    minillm, model, import_s, load_s = _minillm_load(opts)
    out = {
        "runtime": "minillm",
        "kernels": opts.get("kernels", "tuned"),
        "import_s": import_s,
        "load_s": [load_s],
        "peak_rss_after_load_bytes": peak_rss_bytes(),
        "rss_before_import_bytes": rss_start,
    }
    if opts.get("load_only"):
        out.update(process_facts())
        return out
    cfg = model.config
    weights = model.transformer.weights
    kv_max = 0
    log(f"minillm loaded in {load_s:.2f} s; prefill")

    prefill = {}
    for length in opts["prompt_lengths"]:
        ids = prompt_ids(length, cfg.vocab_size, opts["seed"])

        def run(length=length, ids=ids):  # bound now: timed() calls it inside this iteration
            cache = minillm.KVCache.for_model(cfg, max_seq_len=length)
            t0 = time.perf_counter()
            minillm.prefill(model, ids, cache)
            return time.perf_counter() - t0

        prefill[str(length)] = {"seconds": timed(run, opts["repeats"], times_itself=True)}
        kv_max = max(kv_max, length * cfg.kv_bytes_per_token())
    log("minillm decode, each run followed by the matrix products alone")

    ids = prompt_ids(opts["decode_prompt_len"], cfg.vocab_size, opts["seed"])
    minillm_decode(minillm, model, ids, min(8, opts["new_tokens"]))  # warm-up
    seconds, steps, products = [], [], []
    for _ in range(opts["repeats"]):
        s, step_s, kv = minillm_decode(minillm, model, ids, opts["new_tokens"])
        seconds.append(s)
        steps.append(step_s)
        kv_max = max(kv_max, kv)
        # The matrix products alone, right after each decode run: the same minutes of this shared
        # machine's memory bandwidth, which drifts from one minute to the next.
        products += weights_pass_seconds(weights, repeats=20)

    out.update(
        {
            "prefill": prefill,
            "decode": {
                "prompt_tokens": len(ids),
                "new_tokens": opts["new_tokens"],
                "seconds": seconds,
                "step_ms_median": [1e3 * statistics.median(s) for s in steps],
            },
            "weights_pass": {"seconds": products, "bytes": 4 * matmul_parameters(weights)},
            "model": {
                "path": str(model.path),
                "parameters": weights.num_parameters,
                "weights_bytes": weights.nbytes,
                "kv_bytes_per_token": cfg.kv_bytes_per_token(),
                "layers": cfg.num_hidden_layers,
                "d_model": cfg.hidden_size,
                "vocab": cfg.vocab_size,
                "tied_lm_head": cfg.tie_word_embeddings,
                "matmul_parameters": matmul_parameters(weights),
                "dtypes": sorted({str(a.dtype) for a in weights.arrays()}),
            },
            "kv_bytes_max": kv_max,
            "threads": opts["threads"],
            **process_facts(),
        }
    )
    del keep
    return out


def weights_pass_seconds(weights, repeats: int) -> list[float]:
    """A decode step's matrix products and nothing else: one token's ``[1, in]`` activation through
    every projection of every layer and the LM head (``layers.linear``, the forward's own
    function), each pass timed. No norms, attention, RoPE or Python between them: the fastest a
    NumPy decode step over these float32 weights can be on this BLAS and memory."""
    from minillm.model.primitives import linear

    matrices = [w.dense for layer in weights.layers for w in layer.projections()] + [weights.lm_head.dense]
    inputs = [np.ones((1, w.shape[1]), dtype=np.float32) for w in matrices]  # [1, in]

    def one_pass():
        for x, w in zip(inputs, matrices, strict=True):
            linear(x, w)

    return timed(one_pass, repeats, warmup=2)


def matmul_parameters(weights) -> int:
    """Parameters a decode step streams through a matrix product: every projection and the LM
    head (the embedding table is read one row per token, unless it *is* the tied head)."""
    return sum(w.size for layer in weights.layers for w in layer.projections()) + weights.lm_head.size


def measure_minillm_curves(opts: dict) -> dict:
    """How cost grows: prefill time vs prompt length; decode step time vs context length with
    the KV cache and without it (a full recomputation over every position, no cache)."""
    keep = limit_threads(opts["threads"])
    minillm, model, _, _ = _minillm_load(opts)
    cfg, repeats = model.config, opts["curve_repeats"]
    vocab, seed = cfg.vocab_size, opts["seed"]

    log("curves: prefill vs length")
    prefill = []
    for length in opts["curve_lengths"]:
        ids = prompt_ids(length, vocab, seed)

        def run(length=length, ids=ids):  # bound now: timed() calls it inside this iteration
            cache = minillm.KVCache.for_model(cfg, max_seq_len=length)
            t0 = time.perf_counter()
            minillm.prefill(model, ids, cache)
            return time.perf_counter() - t0

        prefill.append(statistics.median(timed(run, repeats, times_itself=True)))

    log("curves: decode step vs position, with the cache")
    max_ctx = opts["curve_max_ctx"]
    ids = prompt_ids(max_ctx, vocab, seed)
    runs = []
    for _ in range(repeats):
        cache = minillm.KVCache.for_model(cfg, max_seq_len=max_ctx)
        minillm.prefill(model, ids[:1], cache)
        steps = []
        for pos in range(1, max_ctx):  # feed ids[pos]; the context becomes pos + 1
            t0 = time.perf_counter()
            minillm.decode_step(model, int(ids[pos]), cache)
            steps.append(time.perf_counter() - t0)
        runs.append(steps)
    with_cache = np.median(np.array(runs), axis=0).tolist()

    log("curves: decode step vs position, without the cache (full recomputation)")
    without_cache = []
    for ctx in opts["curve_nocache_ctx"]:
        without_cache.append(
            statistics.median(
                timed(lambda ctx=ctx: model.transformer.forward(ids[:ctx], None, last_only=True), repeats)
            )
        )
    del keep
    return {
        "runtime": "minillm",
        "repeats": repeats,
        "prefill_vs_length": {"length": list(opts["curve_lengths"]), "seconds": prefill},
        "decode_with_cache": {"ctx": list(range(2, max_ctx + 1)), "seconds": with_cache},
        "decode_without_cache": {"ctx": list(opts["curve_nocache_ctx"]), "seconds": without_cache},
        **process_facts(),
    }


# --- transformers (torch) ------------------------------------------------------------------------
def measure_torch(opts: dict, attn: str) -> dict:
    """transformers on the same folder, float32, ``attn_implementation=attn``, torch threads = cores."""
    keep = limit_threads(opts["threads"])
    rss_start = rss_bytes()
    t0 = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    t1 = time.perf_counter()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(opts["threads"])
    from minillm.sources.hub import resolve_model  # only to find the cached folder; no weights read

    folder = resolve_model(opts["model"], progress=False).path
    t2 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()
    load_s = time.perf_counter() - t2
    runtime = f"torch-{attn}"
    out = {
        "runtime": runtime,
        "import_s": t1 - t0,
        "load_s": [load_s],
        "peak_rss_after_load_bytes": peak_rss_bytes(),
        "rss_before_import_bytes": rss_start,
    }
    if opts.get("load_only"):
        out.update(process_facts())
        return out
    cfg = model.config
    vocab = cfg.vocab_size
    kv_per_token = (
        2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        * 4
    )
    kv_max = 0
    log(f"{runtime} loaded in {load_s:.2f} s; prefill")

    prefill = {}
    with torch.inference_mode():
        for length in opts["prompt_lengths"]:
            ids = torch.from_numpy(prompt_ids(length, vocab, opts["seed"]))[None]  # [1, seq]
            prefill[str(length)] = {
                "seconds": timed(
                    lambda ids=ids: model(input_ids=ids, use_cache=True, logits_to_keep=1), opts["repeats"]
                )
            }
            kv_max = max(kv_max, length * kv_per_token)
        log(f"{runtime} decode")

        class Stamp(LogitsProcessor):
            """Called by ``generate`` right after each forward pass: stamp the clock."""

            def __init__(self):
                self.stamps = []

            def __call__(self, input_ids, scores):
                self.stamps.append(time.perf_counter())
                return scores

        ids = torch.from_numpy(prompt_ids(opts["decode_prompt_len"], vocab, opts["seed"]))[None]
        new = opts["new_tokens"]

        def generate(n):
            stamp = Stamp()
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                num_beams=1,
                logits_processor=LogitsProcessorList([stamp]),
                pad_token_id=cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 0,
            )
            assert len(stamp.stamps) == n, (len(stamp.stamps), n)
            return stamp.stamps

        generate(min(8, new))  # warm-up
        seconds, steps = [], []
        for _ in range(opts["repeats"]):
            stamps = generate(new)
            seconds.append(stamps[-1] - stamps[0])
            steps.append(np.diff(stamps))
        kv_max = max(kv_max, (ids.shape[1] + new) * kv_per_token)

    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out.update(
        {
            "prefill": prefill,
            "decode": {
                "prompt_tokens": int(ids.shape[1]),
                "new_tokens": new,
                "seconds": seconds,
                "step_ms_median": [1e3 * float(np.median(s)) for s in steps],
            },
            "model": {
                "path": str(folder),
                "parameters": sum(p.numel() for p in model.parameters()),
                "weights_bytes": weights_bytes,
                "kv_bytes_per_token": kv_per_token,
            },
            "kv_bytes_max": kv_max,
            "threads": torch.get_num_threads(),
            "torch": {
                "version": torch.__version__,
                "transformers": transformers.__version__,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "mkldnn": torch.backends.mkldnn.is_available(),
                "mkl": torch.backends.mkl.is_available(),
            },
            **process_facts(),
        }
    )
    del keep
    return out


WORKERS = {
    "machine": measure_machine,
    "minillm": measure_minillm,
    "minillm-plain": lambda opts: measure_minillm({**opts, "kernels": "plain"}),
    "minillm-curves": measure_minillm_curves,
    "torch-eager": lambda opts: measure_torch(opts, "eager"),
    "torch-sdpa": lambda opts: measure_torch(opts, "sdpa"),
}


def _cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, busy CPU-seconds of the whole machine, CPU-seconds of this process) now.

    The same as ``minillm.observe.metrics.cpu_snapshot``, kept here because the torch workers must not
    import minillm: their peak RSS is theirs alone."""
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / ticks  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), busy, own.ru_utime + own.ru_stime


def measure(name: str, opts: dict) -> dict:
    """Run worker ``name`` and add how much CPU other processes took meanwhile.

    ``others_cpu_share`` is the CPU time of every other process on the machine during this
    worker, as a share of all cores' time: near 0 on a quiet machine; at 0.25 on 2 cores, other
    work had half a core and the figures are suspect (re-run when ``uptime`` is low).
    """
    wall0, busy0, own0 = _cpu_snapshot()
    result = WORKERS[name](opts)
    wall1, busy1, own1 = _cpu_snapshot()
    cores = os.cpu_count() or 1
    others = max(0.0, (busy1 - busy0) - (own1 - own0))
    result["contention"] = {
        "seconds": wall1 - wall0,
        "own_cpu_s": own1 - own0,
        "others_cpu_s": others,
        "others_cpu_share": others / ((wall1 - wall0) * cores),
    }
    return result


def run_worker(name: str, opts: dict, out_path: str) -> None:
    """The body of ``python -m benchmarks.speed --worker NAME``: measure, write JSON to ``out_path``."""
    result = measure(name, opts)
    with open(out_path, "w") as f:
        json.dump(result, f)
