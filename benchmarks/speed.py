"""minillm's speed against transformers and against this machine's limits, in one run.

    python -m benchmarks.speed                       # everything, medians of 5 runs (~5 min)
    python -m benchmarks.speed --quick               # smoke run: fewer repeats, smaller sizes
    python -m benchmarks.speed --curves              # also: cost vs prompt length and position
    python -m benchmarks.speed --unset-openblas-env  # workers run without OPENBLAS_CORETYPE/_L2_SIZE
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.speed   # the same, by hand

For SmolLM2-135M-Instruct (float32, batch 1, all cores) it measures, each runtime in its own
process (so peak RSS is that runtime's own):

- minillm, transformers eager and transformers sdpa: warm load from the cache (s), prefill
  tokens/s at prompt lengths 16, 128, 512, decode tokens/s over 128 new tokens (greedy, from a
  16-token prompt), peak RSS;
- the machine: memory bandwidth (the best of a 1 GiB NumPy sum and copy split over the cores,
  and a BLAS matrix-vector product over the same GiB) and float32 GEMM GFLOP/s (NumPy), and from
  them two ceilings::

      decode tokens/s  <= bandwidth / bytes read per token (weights streamed + KV cache read)
      prefill tokens/s <= GEMM FLOP/s / (2 x parameters)

It prints the figures, the ratios (minillm / torch eager, minillm / torch sdpa, minillm /
ceiling) and the targets of issue 6 marked pass or fail, and writes the same as JSON
(``--json``, default ``benchmarks/results/local/speed.json``: untracked, so a run never overwrites
the committed ``benchmarks/results/speed.json``; pass ``--json benchmarks/results/speed.json`` to
update that on purpose; ``--save-results`` also writes the tracked
``benchmarks/results/speed-<BLAS kernel>-<threads>t.json`` with the machine's description, from
which the README's table is made: ``benchmarks/speed_results.py``). Each figure is the median of
``--repeats`` runs: the machine has 2 cores shared with whatever else runs, so check ``uptime``
and read the load averages the report prints beside the numbers.

Which BLAS kernel ran matters as much as the code: the report shows threadpoolctl's view of each
worker (library, version, the kernel OpenBLAS picked, threads) and the OPENBLAS_* variables it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import speed_results, workers
from .report import render

SCHEMA = "minillm.benchmarks.speed/1"
RUNTIMES = ("minillm", "torch-eager", "torch-sdpa", "minillm-plain")
DEFAULT_RUNTIMES = RUNTIMES[:3]  # minillm-plain (the textbook's kernels) on request
# Untracked (.gitignore): a run, --quick or not, never overwrites the committed results/speed.json.
DEFAULT_JSON = Path(__file__).parent / "results" / "local" / "speed.json"
COMMITTED_JSON = Path(__file__).parent / "results" / "speed.json"
REPORT_KEYS = (
    "schema",
    "created",
    "command",
    "settings",
    "host",
    "machine",
    "runtimes",
    "figures",
    "ceilings",
    "ratios",
    "targets",
    "curves",
    "workers",
)

# The targets of issue 6.
DECODE_VS_EAGER = 1.3  # minillm decode tokens/s >= 1.3 x transformers eager
DECODE_VS_CEILING = 0.75  # ... and >= 75 % of the bandwidth ceiling
PREFILL_VS_SDPA = 1.0  # prefill tokens/s at 512 >= 1.0 x transformers sdpa
PREFILL_TARGET_LENGTH = 512
LOAD_MAX_S = 2.0  # warm load from the cache
# Issue 25's: a decode step >= 90 % of its matrix products alone (the rest of the step is overhead)
DECODE_VS_PRODUCTS = 0.9
RSS_SLACK = 0.25  # peak RSS <= (float32 weights + KV cache) x 1.25


# --- pure arithmetic (tested exactly in tests/test_benchmark_smoke.py) ---------------------------
def median(values) -> float | None:
    values = [v for v in (values or []) if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing (a runtime not run) or ``b`` is 0."""
    return None if a is None or not b else a / b


def mean_decode_context(prompt_tokens: int, new_tokens: int) -> float:
    """Mean number of cached positions a decode step reads, over the ``new_tokens - 1`` decode
    steps that follow a prefill of ``prompt_tokens`` (step ``k`` attends to ``prompt + k``)."""
    steps = new_tokens - 1
    return prompt_tokens + (steps + 1) / 2 if steps > 0 else float(prompt_tokens)


def decode_bytes_per_token(
    matmul_parameters: int, kv_bytes_per_token: int, context: float, bytes_per_parameter: int = 4
) -> float:
    """Bytes one decode step must read from memory: every projection and the LM head once
    (``matmul_parameters`` x 4 bytes in float32) plus the KV cache's ``context`` positions."""
    return matmul_parameters * bytes_per_parameter + kv_bytes_per_token * context


def decode_ceiling(bandwidth_bytes_per_s: float, bytes_per_token: float) -> float:
    """Decode tokens/s a memory-bound step cannot beat: bandwidth / bytes read per token."""
    return bandwidth_bytes_per_s / bytes_per_token


def prefill_ceiling(flop_per_s: float, parameters: int) -> float:
    """Prefill tokens/s a compute-bound pass cannot beat: FLOP/s / (2 x parameters) (one
    multiply and one add per parameter per token; attention's own FLOPs are left out)."""
    return flop_per_s / (2 * parameters)


def rss_budget(weights_bytes: int, kv_bytes: int, slack: float = RSS_SLACK) -> float:
    """The peak-RSS target: float32 weights + KV cache, plus ``slack`` (25 %)."""
    return (weights_bytes + kv_bytes) * (1 + slack)


def best(values) -> float | None:
    values = [v for v in (values or []) if v is not None]
    return max(values) if values else None


def summarise_runtime(raw: dict, statistic: str = "median") -> dict:
    """One worker's raw runs -> one figure each: load_s, prefill tokens/s per length, decode
    tokens/s, decode step ms, peak RSS. ``statistic`` is "median" (the default) or "best" (the
    fastest run: on a machine others share, the one least disturbed)."""
    pick = median if statistic == "median" else best
    prefill = {length: pick([int(length) / s for s in r["seconds"]]) for length, r in raw.get("prefill", {}).items()}
    decode = raw.get("decode")
    decode_tps = pick([(decode["new_tokens"] - 1) / s for s in decode["seconds"]]) if decode else None
    products = raw.get("weights_pass")
    products_tps = pick([1 / s for s in products["seconds"]]) if products else None
    loads = raw.get("load_s") or []
    return {
        "load_s": median(loads) if statistic == "median" else (min(loads) if loads else None),
        "import_s": raw.get("import_s"),
        "prefill_tokens_per_s": prefill,
        "decode_tokens_per_s": decode_tps,
        "decode_step_ms": None if decode_tps is None else 1e3 / decode_tps,
        # minillm only: a decode step's matrix products alone, as tokens/s (workers.weights_pass_seconds)
        "weights_pass_tokens_per_s": products_tps,
        "peak_rss_bytes": raw.get("peak_rss_bytes"),
    }


def compute_ceilings(machine: dict, model: dict, decode_prompt_len: int, new_tokens: int) -> dict:
    """The machine's limits for this model, from measured bandwidth and GEMM rate."""
    context = mean_decode_context(decode_prompt_len, new_tokens)
    per_token = decode_bytes_per_token(model["matmul_parameters"], model["kv_bytes_per_token"], context)
    bandwidth = machine["bandwidth_gb_s"] * 1e9
    return {
        "bandwidth_gb_s": machine["bandwidth_gb_s"],
        "gemm_gflop_s": machine["gemm_gflop_s"],
        "decode_mean_context": context,
        "decode_bytes_per_token": per_token,
        "decode_tokens_per_s": decode_ceiling(bandwidth, per_token),
        "prefill_parameters": model["parameters"],
        "prefill_tokens_per_s": prefill_ceiling(machine["gemm_gflop_s"] * 1e9, model["parameters"]),
    }


def compute_ratios(figures: dict, ceilings: dict | None) -> dict:
    """minillm / torch eager, minillm / torch sdpa and minillm / ceiling for every figure, and
    minillm's decode / its matrix products alone (the share of a step that streams weights)."""
    mine = figures.get("minillm", {})
    out = {
        "minillm/weights-pass": {
            "decode_tokens_per_s": ratio(mine.get("decode_tokens_per_s"), mine.get("weights_pass_tokens_per_s"))
        }
    }
    for other in ("torch-eager", "torch-sdpa"):
        theirs = figures.get(other, {})
        out[f"minillm/{other}"] = {
            "load_s": ratio(mine.get("load_s"), theirs.get("load_s")),
            "decode_tokens_per_s": ratio(mine.get("decode_tokens_per_s"), theirs.get("decode_tokens_per_s")),
            "prefill_tokens_per_s": {
                n: ratio(v, theirs.get("prefill_tokens_per_s", {}).get(n))
                for n, v in mine.get("prefill_tokens_per_s", {}).items()
            },
            "peak_rss_bytes": ratio(mine.get("peak_rss_bytes"), theirs.get("peak_rss_bytes")),
        }
    if ceilings:
        out["minillm/ceiling"] = {
            "decode_tokens_per_s": ratio(mine.get("decode_tokens_per_s"), ceilings["decode_tokens_per_s"]),
            "weights_pass_tokens_per_s": ratio(mine.get("weights_pass_tokens_per_s"), ceilings["decode_tokens_per_s"]),
            "prefill_tokens_per_s": {
                n: ratio(v, ceilings["prefill_tokens_per_s"]) for n, v in mine.get("prefill_tokens_per_s", {}).items()
            },
        }
    return out


def evaluate_targets(figures: dict, ratios: dict, memory: dict | None) -> list[dict]:
    """Issue 6's targets and issue 25's decode target, each ``{name, value, target, unit, passed}``;
    ``passed`` is None when a figure it needs was not measured (a runtime left out)."""
    mine = figures.get("minillm", {})

    def at_least(name, value, target, unit="x"):
        return {
            "name": name,
            "value": value,
            "target": f">= {target:g}{unit}",
            "passed": None if value is None else value >= target,
        }

    def at_most(name, value, target, unit):
        return {
            "name": name,
            "value": value,
            "target": f"<= {target:,.3g} {unit}",
            "passed": None if value is None else value <= target,
        }

    length = str(PREFILL_TARGET_LENGTH)
    budget = rss_budget(memory["weights_bytes"], memory["kv_bytes"]) if memory else None
    rss = mine.get("peak_rss_bytes")
    return [
        at_least(
            "decode tokens/s vs torch eager",
            ratios.get("minillm/torch-eager", {}).get("decode_tokens_per_s"),
            DECODE_VS_EAGER,
        ),
        at_least(
            "decode tokens/s vs bandwidth ceiling",
            ratios.get("minillm/ceiling", {}).get("decode_tokens_per_s"),
            DECODE_VS_CEILING,
        ),
        at_least(
            f"prefill tokens/s at {length} vs torch sdpa",
            ratios.get("minillm/torch-sdpa", {}).get("prefill_tokens_per_s", {}).get(length),
            PREFILL_VS_SDPA,
        ),
        at_least(
            "decode tokens/s vs the matrix products alone",
            ratios.get("minillm/weights-pass", {}).get("decode_tokens_per_s"),
            DECODE_VS_PRODUCTS,
        ),
        at_most("warm load", mine.get("load_s"), LOAD_MAX_S, "s"),
        {
            "name": "peak RSS",
            "value": None if rss is None else rss / 2**20,
            "target": "<= weights + KV + 25%"
            if budget is None
            else f"<= {budget / 2**20:,.0f} MiB (weights + KV + 25%)",
            "passed": None if rss is None or budget is None else rss <= budget,
        },
    ]


# --- running the workers -------------------------------------------------------------------------
def worker_env(unset_openblas: bool) -> dict:
    env = dict(os.environ)
    if unset_openblas:
        for name in workers.OPENBLAS_VARS:
            env.pop(name, None)
    return env


def spawn(name: str, opts: dict, env: dict, in_process: bool, wait_quiet_s: float = 0.0, say=print) -> dict:
    """Run one worker and return its JSON: in a fresh process, or here (``--in-process``, tests).
    With ``wait_quiet_s`` it first waits, up to that long, for the other processes to go quiet."""
    if wait_quiet_s > 0:
        waited = wait_for_quiet(wait_quiet_s, say)
        if waited > 10:
            say(f"  waited {waited:.0f} s for a quiet machine")
    if in_process:
        return workers.measure(name, opts)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.speed",
            "--worker",
            name,
            "--worker-opts",
            json.dumps(opts),
            "--worker-out",
            str(out),
        ]
        subprocess.run(cmd, env=env, check=True, cwd=Path(__file__).resolve().parent.parent)
        return json.loads(out.read_text())


def machine_busy_share(seconds: float) -> float:
    """Share of all cores' time spent busy over the next ``seconds`` (from /proc/stat)."""

    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields[:8]) - idle, sum(fields[:8])

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_for_quiet(max_wait_s: float, say, busy_below: float = 0.05, window_s: float = 3.0, windows: int = 3) -> float:
    """Wait (at most ``max_wait_s``) until the cores have been idle for ``windows`` windows in a
    row; return the seconds waited. Other engineers' tests share this machine's 2 cores, and a
    2-thread BLAS or OpenMP pool that shares a core slows down not 2x but up to 100x."""
    t0, quiet = time.perf_counter(), 0
    while time.perf_counter() - t0 < max_wait_s:
        try:
            quiet = quiet + 1 if machine_busy_share(window_s) < busy_below else 0
        except OSError:
            return 0.0
        if quiet >= windows:
            break
    waited = time.perf_counter() - t0
    if quiet < windows:
        say(f"  the machine did not become quiet in {max_wait_s:.0f} s; measuring anyway")
    return waited


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def build_opts(args) -> dict:
    return {
        "model": args.model,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine_repeats": max(3, args.repeats),
        "prompt_lengths": args.prompt_lengths,
        "decode_prompt_len": args.decode_prompt_len,
        "new_tokens": args.new_tokens,
        "seed": 0,
        "bandwidth_bytes": args.bandwidth_mib * 2**20,
        "gemm_n": args.gemm_n,
        "curve_lengths": args.curve_lengths,
        "curve_max_ctx": args.curve_max_ctx,
        "curve_nocache_ctx": [c for c in args.curve_nocache_ctx if c <= args.curve_max_ctx],
        "curve_repeats": args.curve_repeats,
    }


def run(args) -> dict:
    """Run every worker the arguments ask for, one after the other; return the report."""
    opts = build_opts(args)
    env = worker_env(args.unset_openblas_env)
    say = (lambda *a: None) if args.silent else (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = time.time()
    load_before = list(os.getloadavg())
    raw: dict[str, dict] = {}
    worker_facts = []

    def note(name, result):
        worker_facts.append(
            {
                "worker": name,
                **{k: result.get(k) for k in ("pid", "blas", "env", "loadavg", "peak_rss_bytes", "contention")},
            }
        )
        return result

    if not args.no_machine:
        say("measuring the machine (bandwidth, GEMM)")
        machine = note("machine", spawn("machine", opts, env, args.in_process, args.wait_quiet, say))
    else:
        machine = None
    for runtime in args.runtimes:
        say(f"measuring {runtime}")
        result = note(runtime, spawn(runtime, opts, env, args.in_process, args.wait_quiet, say))
        for _ in range(args.repeats - 1):  # more warm loads, each in a fresh process
            extra = note(
                runtime + " (load)",
                spawn(runtime, {**opts, "load_only": True}, env, args.in_process, args.wait_quiet, say),
            )
            result["load_s"] += extra["load_s"]
        raw[runtime] = result
    curves = None
    if args.curves and "minillm" in args.runtimes:
        say("measuring curves (minillm)")
        curves = note("minillm-curves", spawn("minillm-curves", opts, env, args.in_process, args.wait_quiet, say))

    figures = {name: summarise_runtime(r, args.statistic) for name, r in raw.items()}
    model = raw.get("minillm", {}).get("model")
    ceilings = compute_ceilings(machine, model, args.decode_prompt_len, args.new_tokens) if machine and model else None
    ratios = compute_ratios(figures, ceilings)
    memory = {"weights_bytes": model["weights_bytes"], "kv_bytes": raw["minillm"]["kv_bytes_max"]} if model else None
    targets = evaluate_targets(figures, ratios, memory)
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.speed", *args.argv]),
        "settings": {
            **opts,
            "runtimes": list(args.runtimes),
            "quick": args.quick,
            "statistic": args.statistic,
            "wait_quiet_s": args.wait_quiet,
            "unset_openblas_env": args.unset_openblas_env,
            "in_process": args.in_process,
            "parent_env": {n: os.environ.get(n) for n in workers.OPENBLAS_VARS},
        },
        "host": {
            "cpu": cpu_name(),
            "cores": default_threads(),
            "python": sys.version.split()[0],
            "loadavg_before": load_before,
            "loadavg_after": list(os.getloadavg()),
            "seconds": time.time() - started,
        },
        "machine": machine,
        "runtimes": raw,
        "figures": figures,
        "ceilings": ceilings,
        "ratios": ratios,
        "targets": targets,
        "memory_budget": memory and {**memory, "budget_bytes": rss_budget(**memory)},
        "curves": curves,
        "workers": worker_facts,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# --- command line --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="manifest name or local folder")
    p.add_argument(
        "--runtimes",
        default=",".join(DEFAULT_RUNTIMES),
        help=f"comma-separated subset of {','.join(RUNTIMES)} (default {','.join(DEFAULT_RUNTIMES)})",
    )
    p.add_argument("--repeats", type=int, default=None, help="runs per figure, median reported (default 5; --quick 2)")
    p.add_argument(
        "--statistic",
        choices=("median", "best"),
        default="median",
        help="figure from the repeats: median (default) or best (the fastest run; steadier on a busy machine)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, 32 new tokens, small machine tests")
    p.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"where to write the report (default {DEFAULT_JSON})"
    )
    p.add_argument(
        "--curves",
        action="store_true",
        help="also measure prefill time vs length and decode step time vs position (with/without cache)",
    )
    p.add_argument("--threads", type=int, default=default_threads(), help="BLAS / torch threads (default: all cores)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[16, 128, 512])
    p.add_argument("--decode-prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=None, help="decode length (default 128; --quick 32)")
    p.add_argument("--bandwidth-mib", type=int, default=None, help="array size for the bandwidth test (default 1024)")
    p.add_argument("--gemm-n", type=int, default=None, help="GEMM size n for n^3 (default 2048)")
    p.add_argument("--curve-lengths", type=int, nargs="+", default=None)
    p.add_argument("--curve-max-ctx", type=int, default=None)
    p.add_argument("--curve-nocache-ctx", type=int, nargs="+", default=None)
    p.add_argument("--curve-repeats", type=int, default=None)
    p.add_argument(
        "--unset-openblas-env",
        action="store_true",
        help="start the workers without OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each worker, wait up to SECONDS for other processes to leave the cores idle",
    )
    p.add_argument(
        "--save-results",
        action="store_true",
        help="also write the report, with the machine's description, to the tracked "
        "benchmarks/results/speed-<BLAS kernel>-<threads>t.json (benchmarks/speed_results.py)",
    )
    p.add_argument("--no-machine", action="store_true", help="skip the bandwidth / GEMM measurements")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the workers in this process (tests); peak RSS is then not per runtime",
    )
    p.add_argument("--silent", action="store_true", help="print nothing (tests)")
    p.add_argument("--worker", choices=sorted(workers.WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--worker-opts", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    quick = args.quick
    args.runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    unknown = set(args.runtimes) - set(RUNTIMES)
    if unknown:
        p.error(f"unknown runtime(s) {', '.join(sorted(unknown))}; choose from {', '.join(RUNTIMES)}")
    defaults = {
        "repeats": (2, 5),
        "new_tokens": (32, 128),
        "bandwidth_mib": (256, 1024),
        "gemm_n": (1024, 2048),
        "curve_lengths": ([1, 16, 64, 256], [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024]),
        "curve_max_ctx": (64, 1024),
        "curve_nocache_ctx": ([1, 16, 64], [1, 16, 64, 128, 256, 512, 768, 1024]),
        "curve_repeats": (1, 3),
    }
    for name, (q, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, q if quick else full)
    if args.repeats < 1 or args.new_tokens < 2:
        p.error("--repeats must be >= 1 and --new-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.worker:  # a child process started by run()
        workers.run_worker(args.worker, json.loads(args.worker_opts), args.worker_out)
        return None
    report = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    saved = speed_results.save(report) if args.save_results else None
    if not args.silent:
        render(report)
        print(f"JSON: {args.json}" + (f" and {saved}" if saved else ""))
    return report


if __name__ == "__main__":
    main()
