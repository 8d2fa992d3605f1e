"""Speculative decoding: tokens per forward pass and decode speed, plain against each draft, in one run.

    python -m benchmarks.speculative                       # SmolLM2, 3 workloads x 4 drafts
    python -m benchmarks.speculative --quick               # smoke run: 16 tokens, the incident only
    python -m benchmarks.speculative --drafts ngram --k 2,4,8

Workloads (greedy, ``--tokens`` new tokens each): the seed's incident report summary
(``examples/incident.txt``: prompt lookup copies names and figures from it), a code edit (the answer
repeats the code), and free chat (little to copy: the ngram draft should give up, not slow it down).
For each workload it runs plain decoding, then every draft and k; greedy speculative ids must equal
the plain ids (checked). Printed per run:

    tokens/pass    new tokens / forward passes of the model (prefill included)
    alpha          drafted tokens kept / drafted tokens
    formula        (1 - alpha^(k+1)) / (1 - alpha): tokens per verifying pass if acceptances were independent
    decode tok/s   (new tokens - 1) / (seconds after the first token): the prefill is the same for all
    speedup        decode tok/s against plain, same workload, same run

Results go to ``benchmarks/results/local/speculative.json`` (untracked) unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = Path(__file__).parent / "results" / "local" / "speculative.json"
CODE = """def total(items):
    x = 0
    for item in items:
        if item.price > 0:
            x = x + item.price * item.quantity
    return x
"""


def workloads() -> dict[str, list[dict]]:
    incident = (ROOT / "examples" / "incident.txt").read_text()
    return {
        "incident summary": [
            {"role": "user", "content": incident + "\n\nSummarize this incident report in two bullets."}
        ],
        "code edit": [{"role": "user", "content": "Rename the variable x to running_total in this code:\n\n" + CODE}],
        "free chat": [{"role": "user", "content": "What should I pack for a weekend hiking trip?"}],
    }


def run_one(model, prompt, tokens: int, speculative) -> dict:
    import minillm

    t = time.perf_counter()
    r = minillm.generate(model, prompt, max_new_tokens=tokens, speculative=speculative)
    total = time.perf_counter() - t
    m = r.metrics
    decode_s = max(total - m.ttft_s, 1e-9)
    alpha = m.accepted_tokens / m.drafted_tokens if m.drafted_tokens else float("nan")
    k = m.speculative_k
    formula = float("nan") if not m.drafted_tokens else (k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha))
    return {
        "ids": r.ids,
        "new_tokens": len(r.ids),
        "target_passes": m.target_passes,
        "drafted": m.drafted_tokens,
        "accepted": m.accepted_tokens,
        "tokens_per_pass": len(r.ids) / m.target_passes,
        "alpha": alpha,
        "formula": formula,
        "decode_tokens_per_s": (len(r.ids) - 1) / decode_s,
        "total_s": total,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=120, help="new tokens per run (default 120)")
    p.add_argument("--drafts", default="ngram,layers:20,self-int8,self-gguf", help="comma-separated drafts")
    p.add_argument("--k", default="4", help="comma-separated tokens drafted per pass (default 4)")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1: steadier on a shared machine)")
    p.add_argument("--quick", action="store_true", help="16 tokens, the incident summary only")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)

    import minillm
    from minillm.observe.metrics import cpu_snapshot, others_cpu_share

    model = minillm.load(args.model, progress=False, threads=args.threads)
    tokens = 16 if args.quick else args.tokens
    chosen = workloads()
    if args.quick:
        chosen = {"incident summary": chosen["incident summary"]}
    ks = [int(k) for k in args.k.split(",")]
    drafts = [d for d in args.drafts.split(",") if d]
    report = {"model": args.model, "tokens": tokens, "threads": args.threads, "runs": []}
    print(f"{'workload':<18} {'draft':<12} {'k':>2} {'tok/pass':>8} {'alpha':>6} {'formula':>7} "
          f"{'decode tok/s':>12} {'speedup':>7}  same ids")  # fmt: skip
    cpu = cpu_snapshot()
    for name, prompt in chosen.items():
        plain = run_one(model, prompt, tokens, None)
        rows = [("plain", 0, plain)]
        for draft in drafts:
            for k in ks:
                rows.append((draft, k, run_one(model, prompt, tokens, minillm.Speculative(draft, num_tokens=k))))
        for draft, k, r in rows:
            same = r["ids"] == plain["ids"]
            speedup = r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
            print(f"{name:<18} {draft:<12} {k:>2} {r['tokens_per_pass']:>8.2f} {r['alpha']:>6.2f} {r['formula']:>7.2f} "
                  f"{r['decode_tokens_per_s']:>12.1f} {speedup:>6.2f}x  {same}")  # fmt: skip
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
