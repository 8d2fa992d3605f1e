"""Aggregate decode throughput against batch size, against this machine's limits, in one run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.batching      # ~3 min
    python -m benchmarks.batching --quick                                          # smoke run
    python -m benchmarks.batching --torch       # also transformers' batched generate (padding)

For SmolLM2-135M-Instruct (float32) and each batch size B in 1, 2, 4, ..., 64 it prefills B
sequences of ``--prompt-tokens`` tokens into one paged pool, then times ``--steps`` decode steps of
``Transformer.forward_batch`` (B rows, one per sequence, each attending over its own blocks) plus
the argmax of each row, the batch sizes interleaved step by step (the ratios against batch 1 then
compare the same minutes). Aggregate decode tokens/s = B / step seconds (median step).

The limits, from the machine measured in the same run (``workers.measure_machine``)::

    memory:  a step reads every weight once, plus each sequence's keys and values
             step >= (weight bytes + B * context * KV bytes per position) / bandwidth
    compute: a step does 2 FLOPs per parameter per row
             step >= 2 * parameters * B / GEMM FLOP/s
    ceiling tokens/s = B / max(memory bound, compute bound)

It also times the matrix products alone for B rows in each formulation of
``minillm/kernels/products.py`` (``plain`` ``x @ W.T``, ``left`` ``W @ x.T``, ``sliced``, ``sliced_gemv``)
and the one ``products.few_rows_product`` picks for this BLAS kernel (``products.PLAN``: what
``TunedKernels.linear`` uses for 2 to 64 rows in a batched pass); with ``--torch``, transformers'
batched ``generate`` on the same prompts, left-padded, greedy.

Prefill against the GEMM ceiling (``--prefill-tokens``, 512): one ``prefill`` over 512 tokens and
its FLOPs: ``2 x layer parameters x 512`` for the projections, ``4 x n_heads x
head_dim x 512 x 513 / 2 x layers`` for attention (the causal half: the scores and values a
token can see), ``2 x d_model x vocab`` for the LM head on the last row. The ceiling is the
machine's GEMM rate in the same run, two ways: a square ``[2048, 2048] @ [2048, 2048]`` (the
rate BLAS reaches on large products) and the prefill's own products alone (one layer's four
projections at 512 rows: the best these shapes get); the % is taken against the higher of the two.
The prefill and both ceilings are timed in alternation, best of 3 each (the square GEMM also
counts its best from the machine measurement at the start).

Every figure is printed with the BLAS kernel and thread count (threadpoolctl) and the share of the
cores other processes used meanwhile (``observe.metrics.others_cpu_share``): on a shared machine a
figure measured beside a busy neighbour is a figure about the neighbour.

Results go to ``benchmarks/results/local/batching.json`` (untracked) unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from . import workers

SCHEMA = "minillm.benchmarks.batching/1"
DEFAULT_JSON = Path(__file__).parent / "results" / "local" / "batching.json"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
# The targets of issue 16 (aggregate decode tokens/s against batch 1).
TARGETS = {8: 3.0, 32: 8.0}
PREFILL_OF_GEMM = 0.75  # prefill-512 FLOP/s >= 75 % of the GEMM ceiling


# --- pure arithmetic (tested exactly in tests/runtime/test_batching.py) ------------------------------------
def step_bounds(
    batch: int,
    weight_bytes: int,
    parameters: int,
    kv_bytes_per_position: int,
    context: float,
    bandwidth_bytes_s: float,
    flop_s: float,
) -> dict:
    """The two lower bounds on a decode step of ``batch`` rows, seconds, and the ceiling tokens/s."""
    memory_s = (weight_bytes + batch * context * kv_bytes_per_position) / bandwidth_bytes_s
    compute_s = 2 * parameters * batch / flop_s
    return {"memory_s": memory_s, "compute_s": compute_s, "ceiling_tokens_s": batch / max(memory_s, compute_s)}


def matrices(model) -> list[np.ndarray]:
    """Every float32 matrix a decode step multiplies by: each layer's projections, then the LM head."""
    out = [a.dense for layer in model.transformer.weights.layers for a in layer.projections()]
    return [*out, model.transformer.weights.lm_head.dense]


# --- measurements ----------------------------------------------------------------------------------
def decode_curve(model, batches: list[int], prompt_tokens: int, steps: int, seed: int = 0) -> dict[int, list[float]]:
    """Seconds of each of ``steps`` batched decode steps (argmax included) for every batch size, the
    sizes interleaved: round ``k`` runs step ``k`` of every batch size in turn, so batch 1 and
    batch 32 meet the same minutes of a shared machine (a neighbour that starts mid-run slows
    both, instead of the sizes measured after it)."""
    from minillm.model.paged_kv_cache import KVCachePool

    T = model.transformer
    vocab = model.config.vocab_size
    positions = prompt_tokens + steps + 1
    runs = {}
    for batch in batches:  # prefill every batch's sequences first (not timed)
        mib = batch * -(-positions // 16) * 16 * model.config.kv_bytes_per_token() / 2**20
        pool = KVCachePool.for_model(model.config, mib)
        seqs = [pool.sequence(positions) for _ in range(batch)]
        tokens = []
        for j, seq in enumerate(seqs):
            pool.grow(seq, prompt_tokens)
            logits = T.forward(workers.prompt_ids(prompt_tokens, vocab, seed + j), seq, last_only=True)
            tokens.append(int(np.argmax(logits[0])))
        runs[batch] = (pool, seqs, tokens)
    times = {batch: [] for batch in batches}
    for _ in range(steps):
        for batch, (pool, seqs, tokens) in runs.items():
            for seq in seqs:
                pool.grow(seq, 1)
            t0 = time.perf_counter()
            logits = T.forward_batch([(np.array([t]), seq) for t, seq in zip(tokens, seqs, strict=True)])
            tokens[:] = [int(i) for i in np.argmax(logits, axis=-1)]
            times[batch].append(time.perf_counter() - t0)
    return times


def products_alone(model, batch: int, repeats: int) -> dict:
    """Seconds for one pass of every matrix product of a decode step with ``batch`` rows, in each
    formulation of ``products.FORMULATIONS`` and as ``few_rows_product`` picks (best of
    ``repeats``, the ways alternated within each repeat)."""
    from minillm.kernels import products

    rng = np.random.default_rng(0)
    mats = matrices(model)
    xs = {m.shape[1]: rng.standard_normal((batch, m.shape[1]), dtype=np.float32) for m in mats}
    ways = {**products.FORMULATIONS, "chosen": products.few_rows_product}
    if batch > 4:  # one matrix-vector product per row and slice: only competitive for 2 rows
        ways.pop("sliced_gemv")
    best = {name: float("inf") for name in ways}
    for _ in range(repeats):
        for name, product in ways.items():
            t0 = time.perf_counter()
            for w in mats:
                product(xs[w.shape[1]], w)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def prefill_flops(config, tokens: int, layer_parameters: int) -> dict:
    """FLOPs of one prefill over ``tokens`` tokens (logits of the last row only), by part."""
    attention = 4 * config.num_attention_heads * config.head_dim * tokens * (tokens + 1) / 2
    return {
        "projections": 2 * layer_parameters * tokens * config.num_hidden_layers,
        "attention": attention * config.num_hidden_layers,  # q.k and p.v over the causal half
        "lm_head": 2 * config.hidden_size * config.vocab_size,
    }


def prefill_vs_gemm(model, tokens: int, repeats: int, square_gflop_s: float) -> dict:
    """Prefill over ``tokens`` tokens against the GEMM ceiling measured now (module docstring)."""
    from minillm.model.kv_cache import KVCache

    T, cfg = model.transformer, model.config
    ids = workers.prompt_ids(tokens, cfg.vocab_size, 0)

    def prefill() -> float:
        cache = KVCache.for_model(cfg, max_seq_len=tokens)
        t0 = time.perf_counter()
        T.forward(ids, cache, last_only=True)
        return time.perf_counter() - t0

    layer = [w.dense for w in T.weights.layers[0].projections()]  # float32 [out, in] each
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((tokens, w.shape[1]), dtype=np.float32) for w in layer]

    def own_products() -> float:
        t0 = time.perf_counter()
        for x, w in zip(xs, layer, strict=True):
            x @ w.T
        return time.perf_counter() - t0

    n = 2048
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), dtype=np.float32)

    def square() -> float:
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        return time.perf_counter() - t0

    prefill()
    runs = {"prefill": [], "own": [], "square": []}
    for _ in range(repeats):  # alternated, so all three meet the same minutes; best of each
        runs["prefill"].append(prefill())
        runs["own"].append(own_products())
        runs["square"].append(square())
    seconds, own_s = min(runs["prefill"]), min(runs["own"])
    square_gflop_s = max(square_gflop_s, 2 * n**3 / min(runs["square"]) / 1e9)  # and the machine's at start
    layer_parameters = sum(w.size for w in layer)
    flops = prefill_flops(cfg, tokens, layer_parameters)
    achieved = sum(flops.values()) / seconds / 1e9
    own_gflop_s = 2 * layer_parameters * tokens / own_s / 1e9
    ceiling = max(own_gflop_s, square_gflop_s)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "flops": flops,
        "achieved_gflop_s": achieved,
        "own_products_gflop_s": own_gflop_s,
        "square_gemm_gflop_s": square_gflop_s,
        "ceiling_gflop_s": ceiling,
        "of_ceiling": achieved / ceiling,
    }


def torch_batched_decode(model, batch: int, prompt_tokens: int, new_tokens: int, threads: int = 1) -> float:
    """transformers' ``generate`` on ``batch`` left-padded prompts, greedy: decode tokens/s from
    ``(T(new_tokens) - T(1)) / (batch * (new_tokens - 1))``, best of 2. torch gets ``threads``
    threads like minillm's BLAS (threadpoolctl does not reach torch's own pool; left alone, it
    spins one thread per core and, on a shared machine, measured 4 tokens/s instead of 100)."""
    import torch
    import transformers

    torch.set_num_threads(threads)

    hf = transformers.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    lengths = [prompt_tokens - (j % 4) * 4 for j in range(batch)]  # different lengths: padding
    ids = torch.full((batch, max(lengths)), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, n in enumerate(lengths):
        ids[j, -n:] = torch.from_numpy(workers.prompt_ids(n, vocab, j))
        mask[j, -n:] = 1

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - t0

    run(2)
    seconds = min(run(new_tokens) for _ in range(2)) - min(run(1) for _ in range(2))
    return batch * (new_tokens - 1) / seconds


def minillm_batched_decode(model, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    """``generate_batch`` on the same prompts as :func:`torch_batched_decode`, the same arithmetic."""
    import minillm

    vocab = model.config.vocab_size
    lengths = [prompt_tokens - (j % 4) * 4 for j in range(batch)]
    texts = [model.tokenizer.decode(workers.prompt_ids(n, vocab, j).tolist()) for j, n in enumerate(lengths)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        minillm.generate_batch(model, texts, max_new_tokens=n, max_batched_tokens=4096, stop_token_ids=None)
        return time.perf_counter() - t0

    run(2)
    seconds = min(run(new_tokens) for _ in range(2)) - min(run(1) for _ in range(2))
    return batch * (new_tokens - 1) / seconds  # (EOS may end a request early: an upper bound on work)


def run(args) -> dict:
    import minillm
    from minillm.kernels import products
    from minillm.observe.metrics import cpu_snapshot, others_cpu_share

    keep = workers.limit_threads(args.threads)
    blas = [
        f"{b.get('internal_api')} {b.get('version')} kernel {b.get('architecture')}, {b.get('num_threads')} threads"
        for b in workers.blas_info()
    ]
    left = sorted(products.PREFILL_LEFT.get(products.blas_kernel(), ()))
    print(
        f"  BLAS: {'; '.join(blas)}; few-rows plan: {products.plan() or 'plain'}; "
        f"prefill products as W @ x.T: {', '.join(left) or 'none'}",
        flush=True,
    )
    machine = workers.measure_machine(
        {
            "threads": args.threads,
            "machine_repeats": 3,
            "bandwidth_bytes": args.bandwidth_mib * 2**20,
            "gemm_n": 1024 if args.quick else 2048,
        }
    )
    model = minillm.load(args.model, progress=False)
    mats = matrices(model)
    weight_bytes, parameters = sum(m.nbytes for m in mats), sum(m.size for m in mats)
    kv = model.config.kv_bytes_per_token()
    rows = []
    before = cpu_snapshot()
    curve = decode_curve(model, args.batches, args.prompt_tokens, args.steps)
    others_decode = others_cpu_share(before, cpu_snapshot()) * (os.cpu_count() or 1)
    print(f"  decode steps of every batch size, interleaved: others kept {others_decode:.2f} cores busy", flush=True)
    for batch in args.batches:
        before = cpu_snapshot()
        times = curve[batch]
        step_s = statistics.median(times[1:] if len(times) > 2 else times)
        context = args.prompt_tokens + args.steps / 2
        bounds = step_bounds(
            batch, weight_bytes, parameters, kv, context, machine["bandwidth_gb_s"] * 1e9, machine["gemm_gflop_s"] * 1e9
        )
        ways = products_alone(model, batch, repeats=2 if args.quick else 4)
        row = {
            "batch": batch,
            "step_s": step_s,
            "tokens_s": batch / step_s,
            **bounds,
            "of_ceiling": batch / step_s / bounds["ceiling_tokens_s"],
            "products_s": ways,
            "formulation": products.formulation(batch),
            "others_cores_decode": others_decode,
            "others_cores_products": others_cpu_share(before, cpu_snapshot()) * (os.cpu_count() or 1),
        }
        rows.append(row)
        alone = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in ways.items())
        print(
            f"  batch {batch:>3}: step {step_s * 1e3:7.1f} ms  {row['tokens_s']:7.1f} tok/s  "
            f"ceiling {bounds['ceiling_tokens_s']:7.1f} ({row['of_ceiling']:.0%})  products alone (ms): {alone}  "
            f"[others kept {row['others_cores_products']:.2f} cores busy]",
            flush=True,
        )
    base = rows[0]["tokens_s"] if rows and rows[0]["batch"] == 1 else None
    ratios = {r["batch"]: r["tokens_s"] / base for r in rows} if base else {}
    limits = {r["batch"]: r["ceiling_tokens_s"] / rows[0]["ceiling_tokens_s"] for r in rows} if base else {}
    # What the products alone allow: batch B's step can be no shorter than its products (chosen
    # formulation), so B x (batch 1's whole step) / (products at B rows) bounds the ratio even if
    # attention, norms and everything else took no time.
    product_bounds = (
        {r["batch"]: r["batch"] * rows[0]["step_s"] / r["products_s"]["chosen"] for r in rows} if base else {}
    )
    if ratios:
        print(
            "  aggregate tokens/s against batch 1: "
            + ", ".join(f"{b}: {v:.2f}x (limits allow {limits[b]:.1f}x)" for b, v in ratios.items())
        )
        print(
            "  bound by the products alone (everything else free): "
            + ", ".join(f"{b}: {v:.1f}x" for b, v in product_bounds.items())
        )
    targets = [
        {
            "name": f"batch {b} / batch 1",
            "value": ratios.get(b),
            "target": t,
            "passed": None if b not in ratios else ratios[b] >= t,
        }
        for b, t in TARGETS.items()
    ]
    report = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": sys.argv,
        "settings": vars(args) | {"json": str(args.json)},
        "load_average": os.getloadavg(),
        "openblas_env": {k: os.environ.get(k) for k in workers.OPENBLAS_VARS},
        "blas": workers.blas_info(),
        "machine": machine,
        "weight_bytes": weight_bytes,
        "parameters": parameters,
        "rows": rows,
        "ratios": ratios,
        "limit_ratios": limits,
        "product_bounds": product_bounds,
        "targets": targets,
    }
    before = cpu_snapshot()
    pre = prefill_vs_gemm(model, args.prefill_tokens, 2 if args.quick else 3, machine["gemm_gflop_s"])
    pre["others_cores"] = others_cpu_share(before, cpu_snapshot()) * (os.cpu_count() or 1)
    report["prefill"] = pre
    print(
        f"  prefill-{pre['tokens']}: {pre['seconds'] * 1e3:.0f} ms, {pre['achieved_gflop_s']:.1f} GFLOP/s; GEMM "
        f"ceiling: square {pre['square_gemm_gflop_s']:.1f}, its own products {pre['own_products_gflop_s']:.1f} "
        f"GFLOP/s -> {pre['of_ceiling']:.0%} of the higher [others kept {pre['others_cores']:.2f} cores busy]"
    )
    report["targets"].append(
        {
            "name": f"prefill-{pre['tokens']} / GEMM ceiling",
            "value": pre["of_ceiling"],
            "target": PREFILL_OF_GEMM,
            "passed": pre["of_ceiling"] >= PREFILL_OF_GEMM,
        }
    )
    if args.torch:
        batch = 8
        report["torch"] = {
            "batch": batch,
            "transformers_tokens_s": torch_batched_decode(
                model, batch, args.prompt_tokens, args.torch_new_tokens, args.threads
            ),
            "minillm_tokens_s": minillm_batched_decode(model, batch, args.prompt_tokens, args.torch_new_tokens),
        }
        t = report["torch"]
        t["ratio"] = t["minillm_tokens_s"] / t["transformers_tokens_s"]
        report["targets"].append(
            {
                "name": "minillm / transformers batched generate (batch 8)",
                "value": t["ratio"],
                "target": 1.5,
                "passed": t["ratio"] >= 1.5,
            }
        )
    del keep
    for t in report["targets"]:
        verdict = "—" if t["passed"] is None else ("pass" if t["passed"] else "FAIL")
        value = "—" if t["value"] is None else f"{t['value']:.2f}"
        print(f"  {t['name']}: {value} (target >= {t['target']}): {verdict}")
    print(f"  load average {report['load_average']}, OPENBLAS env {report['openblas_env']}")
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.batching", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=list(BATCHES))
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (1: the machine is shared)")
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--torch", action="store_true", help="also transformers' batched generate at batch 8")
    p.add_argument("--torch-new-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="smoke run: batches 1,2; 3 steps; small measurements")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.steps, args.prompt_tokens, args.bandwidth_mib = [1, 2], 3, 16, 64
        args.prefill_tokens = 160
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"  wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
