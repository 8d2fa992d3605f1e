"""Speculative decoding: tokens per forward pass and decode speed, plain against each draft, in one run.

    python -m benchmarks.speculative                       # SmolLM2, 3 workloads x 4 drafts
    python -m benchmarks.speculative --quick               # smoke run: 16 tokens, the incident only
    python -m benchmarks.speculative --drafts ngram --k 2,4,8
    python -m benchmarks.speculative --fixed               # k drafts every pass (no adaptive k)
    python -m benchmarks.speculative --lookup-min 1        # ngram: a one-token match proposes too
    python -m benchmarks.speculative --weight-dtype int8   # the model held at int8 (lesson 12)

Workloads (greedy, ``--tokens`` new tokens each): the seed's incident report summary
(``examples/incident.txt``: prompt lookup copies names and figures from it), a code edit (a function
handed back with a comment asked for: SmolLM2's answer repeats the code), and free chat (little to
copy: the ngram draft should give up, not slow it down). For each workload it runs plain decoding,
then every draft and k; greedy speculative ids must equal the plain ids (checked). Printed per run:

    tokens/pass    new tokens / forward passes of the model (prefill included)
    alpha          per position checked: kept / (kept + rejections); the drafts after a pass's first
                   rejection are never checked (speculative.per_position_acceptance)
    k mean         drafted tokens per verifying pass (adaptive k moves between 1 and k)
    per verify     tokens per verifying pass, measured: (kept drafts + one) / verifying passes
    formula        (1 - alpha^(k+1)) / (1 - alpha) at k = k mean: the same if acceptances were independent
                   (and every pass drafted k mean)
    decode tok/s   (new tokens - 1) / (seconds after the first token): the prefill is the same for all;
                   the median of --repeat runs, each configuration's runs interleaved with the others'
    speedup        decode tok/s against plain, same workload, same run

Results go to ``benchmarks/results/local/speculative.json`` (untracked) unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = Path(__file__).parent / "results" / "local" / "speculative.json"
CODE = """def total(items):
    x = 0
    for item in items:
        if item.price > 0:
            x += item.quantity * item.price
        else:
            print("skipping", item.name)
    return x
"""


def workloads() -> dict[str, list[dict]]:
    incident = (ROOT / "examples" / "incident.txt").read_text()
    return {
        "incident summary": [
            {"role": "user", "content": incident + "\n\nSummarize this incident report in two bullets."}
        ],
        "code edit": [
            {
                "role": "user",
                "content": "Here is a Python function:\n\n```python\n" + CODE + "```\n\n"
                "Rewrite it with a comment above the loop. Show the complete code.",
            }
        ],
        "free chat": [{"role": "user", "content": "What should I pack for a weekend hiking trip?"}],
    }


def run_one(model, prompt, tokens: int, speculative) -> dict:
    import minillm
    from minillm.runtime.speculative import expected_tokens_per_pass, per_position_acceptance

    t = time.perf_counter()
    r = minillm.generate(model, prompt, max_new_tokens=tokens, speculative=speculative)
    total = time.perf_counter() - t
    m = r.metrics
    decode_s = max(total - m.ttft_s, 1e-9)
    alpha = per_position_acceptance(m.accepted_tokens, m.rejections)
    k = m.drafted_tokens / m.verify_steps if m.verify_steps else float("nan")
    formula = expected_tokens_per_pass(alpha, k) if m.drafted_tokens else float("nan")
    return {
        "ids": r.ids,
        "new_tokens": len(r.ids),
        "target_passes": m.target_passes,
        "passes_per_token": m.target_passes / len(r.ids),
        "drafted": m.drafted_tokens,
        "accepted": m.accepted_tokens,
        "rejections": m.rejections,
        "tokens_per_pass": len(r.ids) / m.target_passes,
        "alpha": alpha,
        "k_mean": k,
        "per_verify": (m.accepted_tokens + m.verify_steps) / m.verify_steps if m.verify_steps else float("nan"),
        "formula": formula,
        "decode_tokens_per_s": (len(r.ids) - 1) / decode_s,
        "total_s": total,
    }


def run_interleaved(model, prompt, tokens: int, configs: list, repeat: int) -> list[dict]:
    """Each configuration ``repeat`` times, round-robin (a neighbour's burst hits them all alike);
    the counts of the first run, the median decode speed."""
    runs = [[] for _ in configs]
    for _ in range(repeat):
        for out, spec in zip(runs, configs, strict=True):
            out.append(run_one(model, prompt, tokens, spec))
    return [{**r[0], "decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in r)} for r in runs]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=120, help="new tokens per run (default 120)")
    p.add_argument("--drafts", default="ngram,layers:20,self-int8,self-gguf", help="comma-separated drafts")
    p.add_argument("--k", default="4", help="comma-separated tokens drafted per pass (default 4)")
    p.add_argument("--weight-dtype", default="float32", help="how the model holds its matrices (default float32)")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1: steadier on a shared machine)")
    p.add_argument("--fixed", action="store_true", help="draft k tokens every pass (adaptive=False)")
    p.add_argument("--lookup-min", type=int, default=2, help="ngram: shortest n-gram matched (default 2)")
    p.add_argument("--lookup-max", type=int, default=3, help="ngram: longest n-gram matched (default 3)")
    p.add_argument("--repeat", type=int, default=3, help="runs per configuration, interleaved (default 3)")
    p.add_argument("--workloads", default="", help="comma-separated subset, e.g. 'incident summary'")
    p.add_argument("--quick", action="store_true", help="16 tokens, the incident summary only, one run each")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)

    import minillm
    from minillm.observe.metrics import cpu_snapshot, others_cpu_share

    model = minillm.load(args.model, progress=False, threads=args.threads, weight_dtype=args.weight_dtype)
    tokens = 16 if args.quick else args.tokens
    chosen = workloads()
    if args.quick:
        chosen, args.repeat = {"incident summary": chosen["incident summary"]}, 1
    if args.workloads:
        chosen = {name: chosen[name] for name in args.workloads.split(",")}
    ks = [int(k) for k in args.k.split(",")]
    drafts = [d for d in args.drafts.split(",") if d]
    report = {"model": args.model, "weight_dtype": args.weight_dtype, "tokens": tokens, "threads": args.threads,
              "adaptive": not args.fixed,
              "lookup": [args.lookup_min, args.lookup_max], "runs": []}  # fmt: skip
    print(f"{'workload':<18} {'draft':<12} {'k':>2} {'pass/tok':>8} {'alpha':>6} {'k mean':>6} {'per verify':>10} "
          f"{'formula':>7} {'decode tok/s':>12} {'speedup':>7}  same ids")  # fmt: skip
    cpu = cpu_snapshot()
    for name, prompt in chosen.items():
        labels = [("plain", 0)] + [(draft, k) for draft in drafts for k in ks]
        lookup = dict(prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max, adaptive=not args.fixed)
        configs = [None] + [minillm.Speculative(d, num_tokens=k, **lookup) for d, k in labels[1:]]
        results = run_interleaved(model, prompt, tokens, configs, args.repeat)
        plain = results[0]
        for (draft, k), r in zip(labels, results, strict=True):
            same = r["ids"] == plain["ids"]
            speedup = r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
            print(f"{name:<18} {draft:<12} {k:>2} {r['passes_per_token']:>8.2f} {r['alpha']:>6.2f} {r['k_mean']:>6.2f} "
                  f"{r['per_verify']:>10.2f} {r['formula']:>7.2f} {r['decode_tokens_per_s']:>12.1f} {speedup:>6.2f}x  "
                  f"{same}")  # fmt: skip
            report["runs"].append({"workload": name, "draft": draft, "k": k, "same_ids": same, "speedup": speedup,
                                   **{key: v for key, v in r.items() if key != "ids"}})  # fmt: skip
    report["others_cpu_share"] = others_cpu_share(cpu, cpu_snapshot())
    print(f"other processes used {report['others_cpu_share']:.0%} of the cores meanwhile")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"results: {args.json}")
    return report


if __name__ == "__main__":
    main()
