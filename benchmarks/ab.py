"""A/B: this checkout's forward pass against an earlier commit's, in one process, in alternation.

    python -m benchmarks.ab --before HEAD~3            # decode step, prefill-512, batch-8 and batch-32 steps,
                                                       # and single-sequence passes of 2, 8 and 64 rows
    python -m benchmarks.ab --before HEAD~3 --plain    # ... and this checkout's plain kernels beside them

Why one process and alternation: on a shared machine the speed of memory and of the BLAS drifts
from one minute to the next, so two runs minutes apart compare the minutes, not the code. Here
both versions load the same model folder, and each round times both, back to back, the earlier
version first in even rounds and this one first in odd rounds; the medians of the rounds are compared.

Where each copy of the weights lands in memory can change a product's speed by itself, so by
default the whole comparison runs twice, once with each version's model loaded first, and the
ratio reported is the geometric mean of the two (each order's ratio is printed beside it). The
harness's own bias, measured: ``--before HEAD`` times this checkout against an exported copy of
itself (A/A: every ratio should be 1 up to noise).

The earlier version is exported with ``git archive`` into a temporary folder as the package
``minillm_before`` (its ``minillm`` imports rewritten), so both import side by side. Results
go to ``benchmarks/results/local/ab.json`` (untracked) unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "local" / "ab.json"


def export_before(rev: str, into: Path) -> str:
    """Export ``rev``'s ``minillm/`` as the package ``minillm_before`` under ``into``; returns its name."""
    tar = subprocess.run(
        ["git", "archive", rev, "minillm", "weights_manifest.toml"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    package = into / "minillm_before"
    (into / "minillm").rename(package)
    (into / "weights_manifest.toml").rename(package / "weights_manifest.toml")
    for file in package.rglob("*.py"):  # absolute imports of minillm -> minillm_before
        text = file.read_text()
        file.write_text(re.sub(r"\bminillm(?=[.\s])", "minillm_before", text))
    return "minillm_before"


def time_decode(m, model, steps: int, context: int) -> float:
    """Median seconds of one decode step at ``context`` positions (greedy ids, fresh cache)."""
    ids = np.arange(100, 100 + context) % model.config.vocab_size
    cache = m.KVCache.for_model(model.config, max_seq_len=context + steps + 1)
    logits = m.prefill(model, ids, cache)
    times = []
    for _ in range(steps):
        token = int(np.argmax(logits))
        t = time.perf_counter()
        logits = m.decode_step(model, token, cache)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_prefill(m, model, tokens: int) -> float:
    """Seconds of one prefill of ``tokens`` positions."""
    ids = np.arange(200, 200 + tokens) % model.config.vocab_size
    cache = m.KVCache.for_model(model.config, max_seq_len=tokens)
    t = time.perf_counter()
    m.prefill(model, ids, cache)
    return time.perf_counter() - t


def time_batch(m, model, batch: int, steps: int, context: int) -> float:
    """Median seconds of one batched decode step of ``batch`` rows over a paged pool (lesson 11's
    ``decode_step_seconds``: ``context`` random prompt tokens a row, then ``steps`` steps)."""
    cfg, transformer = model.config, model.transformer
    mib = batch * (context // 16 + 3) * 16 * cfg.kv_bytes_per_token() / 2**20  # whole blocks for every row
    pool = m.KVCachePool.for_model(cfg, kv_cache_mib=mib)
    seqs = [pool.sequence(context + steps + 1) for _ in range(batch)]
    rng = np.random.default_rng(batch)
    for seq in seqs:
        pool.grow(seq, context)
        transformer.forward(rng.integers(0, cfg.vocab_size, context), seq, last_only=True)
    times = []
    for _ in range(steps):
        for seq in seqs:
            pool.grow(seq, 1)
        t = time.perf_counter()
        logits = transformer.forward_batch([(np.array([7]), seq) for seq in seqs])
        np.argmax(logits, axis=-1)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_rows(m, model, rows: int, context: int) -> float:
    """Seconds of one single-sequence pass of ``rows`` new tokens onto a cache of ``context`` positions
    (a chunk of a chunked prefill, or speculative decoding's verification of ``rows`` drafted tokens)."""
    ids = np.arange(300, 300 + context + rows) % model.config.vocab_size
    cache = m.KVCache.for_model(model.config, max_seq_len=context + rows)
    m.prefill(model, ids[:context], cache)
    t = time.perf_counter()
    model.transformer.forward(ids[context:], cache, last_only=True)
    return time.perf_counter() - t


def blas_pools() -> list[dict]:
    """The BLAS pools this process runs (threadpoolctl): library, kernel (``architecture``), threads."""
    from threadpoolctl import threadpool_info

    keys = ("internal_api", "architecture", "num_threads", "version")
    return [{k: pool.get(k) for k in keys} for pool in threadpool_info() if pool.get("user_api") == "blas"]


def plain_twin(model):
    """A copy of ``model`` (the same weights) whose transformer runs the plain kernels."""
    import copy

    from minillm.model.kernels import PLAIN
    from minillm.model.transformer import Transformer

    twin = copy.copy(model)
    twin.transformer = Transformer(model.config, model.transformer.weights, PLAIN)
    return twin


ROWS = (2, 8, 64)  # single-sequence passes the few-rows products may serve
FIGURES = ("decode_s", "prefill_s", "batch8_s", "batch32_s", *(f"rows{n}_s" for n in ROWS))


def time_round(m, model, args) -> dict[str, float]:
    """One round of every figure for one version: ``{figure: seconds}``."""
    out = {
        "decode_s": time_decode(m, model, args.steps, args.context),
        "prefill_s": time_prefill(m, model, args.prefill_tokens),
        "batch8_s": time_batch(m, model, 8, 8, args.context),
        "batch32_s": time_batch(m, model, 32, 8, args.context),
    }
    for n in ROWS:
        out[f"rows{n}_s"] = time_rows(m, model, n, args.context)
    return out


def run_order(modules: dict, load_order: tuple[str, ...], args) -> dict[str, dict[str, list[float]]]:
    """Load both versions' models in ``load_order``, then time ``args.rounds`` alternating rounds:
    ``{version: {figure: [seconds per round]}}``. The models are freed before returning."""
    import gc

    loaded = {name: modules[name].load(args.model, progress=False) for name in load_order}
    models = {name: loaded[name] for name in ("before", "after")}
    if args.plain:
        models["after_plain"] = plain_twin(models["after"])
    times: dict[str, dict[str, list[float]]] = {k: {f: [] for f in FIGURES} for k in models}
    for r in range(args.rounds):
        for name in list(models) if r % 2 == 0 else list(models)[::-1]:  # who goes first alternates
            m = modules["after" if name == "after_plain" else name]
            for figure, seconds in time_round(m, models[name], args).items():
                times[name][figure].append(seconds)
    del loaded, models
    gc.collect()
    return times


def over_before(by_order: dict, version: str, figure: str) -> dict[str, float]:
    """``{load order: median seconds of version / median seconds of before}`` for one figure."""
    return {
        o: statistics.median(t[version][figure]) / statistics.median(t["before"][figure]) for o, t in by_order.items()
    }


ORDERS = {"before-first": ("before", "after"), "after-first": ("after", "before")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the earlier git revision (e.g. HEAD~3 or a commit)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per load order (default 7)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round (default 32)")
    parser.add_argument("--context", type=int, default=64, help="positions in the cache while decoding")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--plain", action="store_true", help="also time this checkout's plain kernels")
    parser.add_argument(
        "--load-order",
        choices=("both", *ORDERS),
        default="both",
        help="which version's model is loaded first; 'both' (default) runs each order in turn and "
        "reports the geometric mean of the two ratios, so where the weights land cancels out",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write results ({DEFAULT_JSON})")
    args = parser.parse_args(argv)
    orders = list(ORDERS) if args.load_order == "both" else [args.load_order]

    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        before = importlib.import_module(export_before(args.before, Path(tmp)))
        import minillm as after

        modules = {"before": before, "after": after}
        by_order = {order: run_order(modules, ORDERS[order], args) for order in orders}
    report = {
        "before": args.before,
        "blas": blas_pools(),
        "rounds": args.rounds,
        "load_orders": orders,
        "steps": args.steps,
        "context": args.context,
        "prefill_tokens": args.prefill_tokens,
        "times": by_order,
    }
    print("BLAS:", ", ".join(f"{p['internal_api']} {p['architecture']} x{p['num_threads']}" for p in report["blas"]))
    print(f"{args.before} against this checkout, {args.rounds} rounds per load order ({', '.join(orders)})")
    print(f"{'':10s} " + "  ".join(f"{o:>12s}" for o in orders) + "   after / before (geometric mean)")
    for figure in FIGURES:
        ratios = over_before(by_order, "after", figure)
        mean = statistics.geometric_mean(ratios.values())
        report[figure] = {"after_over_before": mean, "by_load_order": ratios}
        line = f"{figure:10s} " + "  ".join(f"{ratios[o]:12.3f}" for o in orders) + f"   {mean:.3f}"
        if args.plain:
            plain = over_before(by_order, "after_plain", figure)
            report[figure]["plain_over_before"] = statistics.geometric_mean(plain.values())
            line += f"   plain / before {report[figure]['plain_over_before']:.3f}"
        print(line)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
