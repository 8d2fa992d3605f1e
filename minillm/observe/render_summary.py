"""The summary a trace ends with, printed with rich: the request's numbers, the memory tables (the
weights in each format, as held, the KV cache per dtype) and the diagnosis of each phase."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from minillm.model.config import KV_DTYPES
from minillm.observe.metrics import WEIGHT_FORMATS, bits_per_weight, format_bytes
from minillm.runtime.speculative import expected_tokens_per_pass, per_position_acceptance


def print_summary(c: Console, m: dict, full: bool = True) -> None:
    """Print the ``summary`` event's data ``m`` (``RequestMetrics`` as a dict, plus memory and diagnosis):
    ``full``, a row per number, the memory tables and the diagnosis with its calibration; else a few
    lines and the diagnosis as one small table (:func:`print_compact_summary`)."""
    if not full:
        print_compact_summary(c, m)
        return
    rows = [
        ("load", f"{m['load_s']:.2f} s"),
        ("warm-up", "skipped" if m.get("warmup_s") is None else f"{m['warmup_s']:.2f} s"),
        ("prompt tokens", f"{m['prompt_tokens']}"),
        ("new tokens", f"{m['new_tokens']}"),
        ("TTFT", f"{m['ttft_s'] * 1e3:.1f} ms"),
        (
            "TPOT mean / p50 / p90",
            f"{m['tpot_s'] * 1e3:.1f} / {m['tpot_p50_s'] * 1e3:.1f} / {m['tpot_p90_s'] * 1e3:.1f} ms",
        ),
        ("prefill", f"{m['prefill_tokens_per_s']:,.0f} tokens/s"),
        ("decode", f"{m['decode_tokens_per_s']:,.1f} tokens/s"),
        ("total", f"{m['total_s']:.2f} s"),
        (
            "other processes' CPU",
            "unknown"
            if m["others_cpu_share"] != m["others_cpu_share"]  # NaN
            else f"{m['others_cpu_share']:.0%} of the cores",
        ),
        *_speculative_rows(m),
        ("KV cache per token", f"{format_bytes(m['kv_bytes_per_token'])} ({m.get('kv_dtype', 'float32')})"),
        (
            "KV cache this request",
            f"{format_bytes(m['kv_bytes_used'])} used of {format_bytes(m['kv_bytes_reserved'])} reserved",
        ),
    ]
    c.rule("[bold]summary")
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan")
    table.add_column(justify="right")
    for row in rows:
        table.add_row(*row)
    c.print(table)
    if "weight_bytes" in m:
        c.print(memory_table(m))
    if m.get("weights_held"):
        c.print(held_table(m["weights_held"]))
    if "diagnosis" in m:
        print_diagnosis(c, m["diagnosis"], m.get("calibration"))


def memory_table(m: dict) -> Table:
    """What the weights would take in each format (real block sizes), and the KV cache per dtype."""
    table = Table(
        title=f"memory: {m['parameters']:,} parameters, context {m['context']:,}",
        title_justify="left",
        caption="* the KV dtype this request used",
        caption_justify="left",
        box=None,
        padding=(0, 2),
    )
    for col in ("weights as", "bits", "bytes", "KV as", "per token", "full context"):
        table.add_column(col, justify="left" if col in ("weights as", "KV as") else "right")
    weights, kv = list(m["weight_bytes"].items()), list(m["kv_bytes"].items())
    for i in range(max(len(weights), len(kv))):
        w = ("", "", "")
        if i < len(weights):
            name, nbytes = weights[i]
            w = (name, f"{bits_per_weight(WEIGHT_FORMATS[name]):.2f}", format_bytes(nbytes))
        k = ("", "", "")
        if i < len(kv):
            name, (per_token, full) = kv[i]
            label = f"{name}+scale" if KV_DTYPES[name][1] else name  # int8 stores a scale beside its values
            in_use = name == m.get("kv_dtype", "float32")
            k = (f"{label} *" if in_use else label, format_bytes(per_token), format_bytes(full))
        table.add_row(*w, *k)
    return table


def held_table(held: dict) -> Table:
    """The formats this model's weights are actually held in, at their real block sizes."""
    table = Table(title="weights as held by this model", title_justify="left", box=None, padding=(0, 2))
    for col in ("format", "weights", "bits / weight"):
        table.add_column(col, justify="right" if col != "format" else "left")
    rows = [(f, r) for f, r in held.items() if f != "total" or len(held) > 2]  # a total only for a mix
    for fmt, row in rows:
        table.add_row(fmt, format_bytes(row["bytes"]), f"{row['bits_per_weight']:.2f}")
    return table


def print_compact_summary(c: Console, m: dict) -> None:
    """The summary in a few lines: times and rates, sizes, the speculative rows, and the diagnosis with
    a column per phase (measured, expected, ratio), then its findings or "healthy"."""
    c.rule("[bold]summary")
    c.print(
        f"TTFT {_seconds(m['ttft_s'])}; TPOT {m['tpot_s'] * 1e3:.1f} ms (p50 {m['tpot_p50_s'] * 1e3:.1f}, "
        f"p90 {m['tpot_p90_s'] * 1e3:.1f}); tokens/s: prefill {m['prefill_tokens_per_s']:,.0f}, "
        f"decode {m['decode_tokens_per_s']:,.1f}"
    )
    share = m["others_cpu_share"]
    warmup = "skipped" if m.get("warmup_s") is None else f"{m['warmup_s']:.2f} s"
    c.print(
        f"{m['prompt_tokens']} prompt + {m['new_tokens']} new tokens in {m['total_s']:.2f} s; load "
        f"{m['load_s']:.2f} s, warm-up {warmup}; "
        + ("others' share of the cores unknown" if share != share else f"others used {share:.0%} of the cores")
    )
    for key, value in _speculative_rows(m):
        c.print(f"{key}: {value}")
    d = m.get("diagnosis")
    if not d:
        return
    threshold, checks, findings = d.get("threshold", 2.0), d.get("checks", []), d["findings"]
    n = len(findings)
    verdict = f"[bold red]{n} finding{'s' if n > 1 else ''}[/]" if n else "[bold green]healthy[/]"
    if not checks:
        c.print(f"diagnosis: {verdict}")
    else:  # a column per phase; the verdict heads it
        table = Table(box=None, padding=(0, 2))
        table.add_column(f"diagnosis: {verdict}", style="cyan")
        for phase, *_ in checks:
            table.add_column(_PHASE_NAMES.get(phase, phase), justify="right")
        table.add_row("measured", *(_seconds(measured) for _, measured, _, _ in checks))
        table.add_row("expected", *("?" if e is None else _seconds(e) for _, _, e, _ in checks))
        table.add_row(f"ratio (slow > {threshold:g}x)", *(_ratio(e, r, threshold) for _, _, e, r in checks))
        c.print(table)
    for _phase, symptom, points_to in findings:
        c.print(f"  [bold]{escape(symptom)}[/] -> {escape(points_to)}")


def print_diagnosis(c: Console, d: dict, calibration: dict | None = None) -> None:
    """Print the diagnosis: each phase measured against what this machine should take, then the findings."""
    threshold = d.get("threshold", 2.0)
    c.print(f"[bold]diagnosis[/]: each phase against what this machine should take (slow above {threshold:g}x)")
    table = Table(box=None, padding=(0, 2))
    for col in ("phase", "measured", "expected", "ratio"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase, measured, expected, ratio in d.get("checks", []):
        table.add_row(
            _PHASE_NAMES.get(phase, phase),
            _seconds(measured),
            "?" if expected is None else _seconds(expected),
            _ratio(expected, ratio, threshold),
        )
    c.print(table)
    if calibration:
        share = calibration.get("others_cpu_share", float("nan"))
        c.print(
            f"[dim]expected from this machine's rates ({calibration['bandwidth_gb_s']:.1f} GB/s matrix-vector, "
            f"{calibration['gemm_gflop_s']:.0f} GFLOP/s GEMM"
            + ("" if share != share else f"; others used {share:.0%} of the cores while measuring")
            + (f"; measured just now in {calibration['seconds']:.1f} s" if calibration.get("measured_now") else "")
            + ("; on a busy machine: not kept, the next run measures again" if calibration.get("busy") else "")
            + "; `minillm calibrate` redoes it)[/]"
        )
    _print_findings(c, d, threshold)


_PHASE_NAMES = {"loading": "loading (local files)", "prefill": "TTFT (prefill)", "decode": "TPOT (decode)"}


def _print_findings(c: Console, d: dict, threshold: float) -> None:
    if not d["findings"]:
        c.print(f"[bold green]healthy[/]: every phase within {threshold:g}x of what this machine should take")
    for _phase, symptom, points_to in d["findings"]:
        c.print(f"  [bold]{escape(symptom)}[/] -> {escape(points_to)}")


def _ratio(expected: float | None, ratio: float, threshold: float) -> Text | str:
    if expected is None:
        return ""
    return Text(f"{ratio:.1f}x", style="bold red" if ratio > threshold else "green")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _speculative_rows(m: dict) -> list[tuple[str, str]]:
    """The summary's speculative rows: drafts kept, α per position checked (kept / (kept + rejections),
    ``speculative.per_position_acceptance``), tokens per pass, and what the formula
    ``(1 - α^(k+1)) / (1 - α)`` predicts for passes that verified drafts, at ``k`` the drafts per
    verifying pass on average (adaptive k moves below its most)."""
    if not m.get("drafted_tokens"):
        return []
    most, steps = m.get("speculative_k", 0), m["verify_steps"]
    alpha = per_position_acceptance(m["accepted_tokens"], m.get("rejections", 0))
    k = m["drafted_tokens"] / steps
    formula = expected_tokens_per_pass(alpha, k)
    per_verify = (m["accepted_tokens"] + steps) / steps
    return [
        (
            "speculative",
            f"{m['accepted_tokens']}/{m['drafted_tokens']} drafts kept (α {alpha:.2f}), "
            f"k {k:.1f} per verify (at most {most})",
        ),
        ("tokens per pass", f"{m['tokens_per_pass']:.2f} overall, {per_verify:.2f} per verify (formula {formula:.2f})"),
    ]
