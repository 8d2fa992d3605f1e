"""The benchmark's report as rich tables: figures and ratios, targets, the machine, BLAS pools.

``render(report)`` prints what ``benchmarks.speed.run`` returns (the same dict it writes as JSON).
"""

from __future__ import annotations

import sys

NOISY_SHARE = 0.05  # other processes took more than 5 % of all cores' time during a worker


# --- the report ----------------------------------------------------------------------------------
def _fmt(value, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def _verdict(passed) -> str:
    return {True: "[bold green]pass[/]", False: "[bold red]FAIL[/]", None: "[dim]n/a[/]"}[passed]


def render(report: dict, console=None) -> None:
    """Print the figures, ratios, targets and BLAS facts as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 132)
    figs, ceil, ratios = report["figures"], report["ceilings"] or {}, report["ratios"]
    mine = figs.get("minillm", {})
    eager, sdpa = figs.get("torch-eager", {}), figs.get("torch-sdpa", {})
    r_eager, r_sdpa = ratios.get("minillm/torch-eager", {}), ratios.get("minillm/torch-sdpa", {})
    r_ceil = ratios.get("minillm/ceiling", {})

    table = Table(
        title=f"SmolLM2-135M-Instruct float32, batch 1, {report['settings']['threads']} threads, "
        f"{report['settings'].get('statistic', 'median')} of {report['settings']['repeats']}",
        title_justify="left",
    )
    for col in (
        "figure",
        "minillm",
        "torch eager",
        "torch sdpa",
        "ceiling",
        "minillm ÷ eager",
        "minillm ÷ sdpa",
        "minillm ÷ ceiling",
    ):
        table.add_column(col, justify="left" if col == "figure" else "right")
    table.add_row(
        "warm load (s)",
        _fmt(mine.get("load_s"), ".2f"),
        _fmt(eager.get("load_s"), ".2f"),
        _fmt(sdpa.get("load_s"), ".2f"),
        "",
        _fmt(r_eager.get("load_s"), ".2f"),
        _fmt(r_sdpa.get("load_s"), ".2f"),
        "",
    )
    lengths = sorted({n for f in figs.values() for n in f.get("prefill_tokens_per_s", {})}, key=int)
    for length in lengths:
        table.add_row(
            f"prefill {length} (tok/s)",
            _fmt(mine.get("prefill_tokens_per_s", {}).get(length), ",.0f"),
            _fmt(eager.get("prefill_tokens_per_s", {}).get(length), ",.0f"),
            _fmt(sdpa.get("prefill_tokens_per_s", {}).get(length), ",.0f"),
            _fmt(ceil.get("prefill_tokens_per_s"), ",.0f"),
            _fmt(r_eager.get("prefill_tokens_per_s", {}).get(length), ".2f"),
            _fmt(r_sdpa.get("prefill_tokens_per_s", {}).get(length), ".2f"),
            _fmt(r_ceil.get("prefill_tokens_per_s", {}).get(length), ".0%"),
        )
    table.add_row(
        "decode (tok/s)",
        _fmt(mine.get("decode_tokens_per_s"), ".1f"),
        _fmt(eager.get("decode_tokens_per_s"), ".1f"),
        _fmt(sdpa.get("decode_tokens_per_s"), ".1f"),
        _fmt(ceil.get("decode_tokens_per_s"), ".1f"),
        _fmt(r_eager.get("decode_tokens_per_s"), ".2f"),
        _fmt(r_sdpa.get("decode_tokens_per_s"), ".2f"),
        _fmt(r_ceil.get("decode_tokens_per_s"), ".0%"),
    )
    products = mine.get("weights_pass_tokens_per_s")
    table.add_row(
        "  its matrix products alone (tok/s)",
        _fmt(products, ".1f"),
        "",
        "",
        _fmt(ceil.get("decode_tokens_per_s"), ".1f"),
        "",
        "",
        _fmt(r_ceil.get("weights_pass_tokens_per_s"), ".0%"),
    )
    table.add_row(
        "decode step (ms)",
        _fmt(mine.get("decode_step_ms"), ".1f"),
        _fmt(eager.get("decode_step_ms"), ".1f"),
        _fmt(sdpa.get("decode_step_ms"), ".1f"),
        _fmt(1e3 / ceil["decode_tokens_per_s"] if ceil else None, ".1f"),
        "",
        "",
        "",
    )
    mib = lambda b: None if b is None else b / 2**20  # noqa: E731
    table.add_row(
        "peak RSS (MiB)",
        _fmt(mib(mine.get("peak_rss_bytes")), ",.0f"),
        _fmt(mib(eager.get("peak_rss_bytes")), ",.0f"),
        _fmt(mib(sdpa.get("peak_rss_bytes")), ",.0f"),
        _fmt(mib((report.get("memory_budget") or {}).get("budget_bytes")), ",.0f"),
        _fmt(r_eager.get("peak_rss_bytes"), ".2f"),
        _fmt(r_sdpa.get("peak_rss_bytes"), ".2f"),
        "",
    )
    console.print(table)
    if ceil:
        console.print(
            f"ceilings: decode <= {ceil['bandwidth_gb_s']:.1f} GB/s / {ceil['decode_bytes_per_token'] / 1e6:.1f} MB "
            f"per token (weights + KV at mean context {ceil['decode_mean_context']:.0f}); prefill <= "
            f"{ceil['gemm_gflop_s']:.1f} GFLOP/s / (2 x {ceil['prefill_parameters']:,} parameters). "
            "The RSS 'ceiling' is the target budget: float32 weights + KV cache + 25%."
        )
    if products:
        share = ratios.get("minillm/weights-pass", {}).get("decode_tokens_per_s")
        console.print(
            f"'its matrix products alone': one token through every projection and the LM head with nothing "
            f"between them, {1e3 / products:.1f} ms: the fastest a NumPy decode step over these weights can be "
            f"here. minillm's whole step takes {_fmt(share, '.0%')} of that speed; the rest of the step is norms, "
            "RoPE, attention and Python."
        )

    targets = Table(title="targets (issue 6)", title_justify="left")
    for col in ("target", "measured", "threshold", ""):
        targets.add_column(col, justify="left" if col == "target" else "right")
    for t in report["targets"]:
        unit = "s" if t["name"] == "warm load" else ("MiB" if t["name"] == "peak RSS" else "x")
        value = _fmt(t["value"], ",.0f" if unit == "MiB" else ".2f")
        targets.add_row(
            t["name"], value + ("" if t["value"] is None else f" {unit}"), t["target"], _verdict(t["passed"])
        )
    console.print(targets)

    machine = report.get("machine")
    if machine:
        console.print(
            f"machine: {report['host']['cpu']}, {report['host']['cores']} cores; memory: sum "
            f"{machine['read_gb_s']:.1f} GB/s ({machine['read_1thread_gb_s']:.1f} on one thread), "
            f"copy {machine['copy_gb_s']:.1f} GB/s (read + write), BLAS gemv {machine['gemv_gb_s']:.1f} "
            f"GB/s -> bandwidth {machine['bandwidth_gb_s']:.1f} GB/s (the best); float32 GEMM "
            f"{machine['gemm_n']}^3 {machine['gemm_gflop_s']:.1f} GFLOP/s"
        )
    blas = Table(title="BLAS and OpenMP pools each worker ran (threadpoolctl)", title_justify="left")
    for col in (
        "worker",
        "library",
        "version",
        "kernel",
        "threads",
        "OPENBLAS_CORETYPE",
        "OPENBLAS_L2_SIZE",
        "others' CPU",
    ):
        blas.add_column(col)
    for w in report["workers"]:
        if w["worker"].endswith("(load)"):
            continue
        share = (w.get("contention") or {}).get("others_cpu_share")
        for pool in w.get("blas") or [{}]:
            blas.add_row(
                w["worker"],
                f"{pool.get('prefix', '?')} ({pool.get('internal_api', '?')})",
                str(pool.get("version")),
                str(pool.get("architecture") or pool.get("corename") or "—"),
                str(pool.get("num_threads")),
                str((w.get("env") or {}).get("OPENBLAS_CORETYPE")),
                str((w.get("env") or {}).get("OPENBLAS_L2_SIZE")),
                _fmt(share, ".0%"),
            )
    console.print(blas)
    console.print(
        "'others' CPU': the share of all cores' time that other processes used while the worker "
        "ran. NumPy's OpenBLAS is the one minillm calls; torch computes with its own MKL/oneDNN, "
        "which threadpoolctl does not list (a scipy OpenBLAS that transformers imports may show)."
    )
    noisy = [
        f"{w['worker']} {w['contention']['others_cpu_share']:.0%}"
        for w in report["workers"]
        if (w.get("contention") or {}).get("others_cpu_share", 0) > NOISY_SHARE
    ]
    if noisy:
        console.print(
            f"[bold yellow]noisy:[/] other processes used the cores during {', '.join(noisy)}; "
            "those figures are suspect. Re-run when `uptime` is low."
        )
    for name in ("torch-eager", "torch-sdpa"):
        info = report["runtimes"].get(name, {}).get("torch")
        if info:
            console.print(
                f"{name}: torch {info['version']}, transformers {info['transformers']}, "
                f"CPU capability {info['cpu_capability']}, mkldnn {info['mkldnn']}, mkl {info['mkl']}"
            )
            break
    host = report["host"]
    console.print(
        f"load average before {host['loadavg_before'][0]:.2f}, after {host['loadavg_after'][0]:.2f} "
        f"(1 min) on {host['cores']} cores; run took {host['seconds']:.0f} s. Above ~0.5 per core "
        "other work shared the cores: re-run when `uptime` is low."
    )
