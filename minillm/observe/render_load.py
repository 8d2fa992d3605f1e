"""The load event, printed with rich: one line of weights and one of BLAS by default; under
``-v full`` the model's config, weights and tokenizer tables, and the seconds of each loading step."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from minillm.observe.metrics import format_bytes


def kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    """A two-column table without borders: keys in cyan, values as text."""
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, escape(str(value)))
    return table


def print_load(c: Console, d: dict, seconds: float, full: bool) -> None:
    """Print the ``load`` event's data ``d`` (``describe.load``) that took ``seconds``; ``full``: every table."""
    c.rule(f"[bold]load[/] {escape(d['name'])}  ({seconds:.2f} s)")
    w = d["weights"]
    how = "memory-mapped, paged in on first use" if w.get("mapped") else "in memory"
    if full:
        c.print(f"source: [green]{d['source']}[/]  folder: {escape(str(d['path']))}")
        for note in d.get("notes", []):
            c.print(f"  note: {escape(note)}")
        c.print(kv_table("config", list(d["config"].items())))
        c.print(kv_table("weights", _weight_rows(w, how)))
        t = d["tokenizer"]
        special = [("vocab", f"{t['vocab_size']:,}"), ("special", t["special"]), ("eos ids", t["eos_ids"])]
        c.print(kv_table("tokenizer", special))
    else:  # where it came from (the notes say it; the folder under -v full), its size and shape in one line
        notes = [n.replace(f" {d['path']}", "") for n in d.get("notes", [])] or [d["source"]]
        c.print(f"source: {escape('; '.join(notes))}")
        cfg = d["config"]
        c.print(
            f"{w['parameters']:,} parameters ({escape(str(cfg['family']))}, {cfg['layers']} layers, "
            f"d_model {cfg['d_model']}) held as {held(w)}, {how}"
        )
    for a in d.get("adapters", []):  # LoRA: W' = W + scaling * (B A)^T, merged or computed apart
        c.print(kv_table(f"LoRA adapter {a['name']} ({a['mode']})", _adapter_rows(a)))
    if full:
        c.print("seconds per step: " + ", ".join(f"{k} {v:.2f}" for k, v in d["seconds"].items()))
        for blas in d.get("blas", []):
            c.print(f"BLAS: {escape(blas)}")
        if k := d.get("kernels"):
            c.print(f"kernels: {escape(k['name'])} ({escape(k['source'])})")
        return
    k = d.get("kernels")
    parts = [f"BLAS: {escape(b)}" for b in d.get("blas", [])]
    parts += [f"kernels: {escape(k['name'])} ({escape(k['source'])})"] if k else []
    if parts:
        c.print("; ".join(parts))


def _weight_rows(w: dict, how: str) -> list[tuple[str, str]]:
    rows = [("parameters", f"{w['parameters']:,}"), ("held as", f"{held(w)}, {how}")]
    rows += [(f"stored {k}", f"{n:,} params, {format_bytes(w['bytes_stored'][k])}") for k, n in w["stored"].items()]
    if w.get("seconds"):
        rows.append(("seconds", ", ".join(f"{k} {v:.2f}" for k, v in w["seconds"].items())))
    if w.get("unused"):
        rows.append(("unused tensors", ", ".join(w["unused"])))
    return rows


def _adapter_rows(a: dict) -> list[tuple[str, str]]:
    folded = " (folded into the weights)" if a["mode"] == "merged" else " (kept beside the weights)"
    return [
        ("rank, alpha", f"r={a['rank']}, alpha={a['alpha']:g}"),
        ("scaling", f"{a['scaling']:.4g} (alpha / {'sqrt(r), rsLoRA' if a['rslora'] else 'r'})"),
        ("targets", f"{', '.join(a['targets'])} in {a['layers']} layers ({a['modules']} modules)"),
        ("adds", f"{a['parameters']:,} params, {format_bytes(a['bytes'])}" + folded),
        ("load", f"{a['seconds']:.2f} s"),
    ]


def held(w: dict) -> str:
    """The weights as held in memory, by format: ``float32 513.1 MiB``, or for ``weight_dtype="int8"``
    ``int8 103.9 MiB + float32 25.3 MiB = 129.2 MiB`` (norms, and what the format leaves float32)."""
    formats = w.get("held") or {"float32": [w["parameters"], w["bytes_loaded"]]}
    parts = [f"{fmt} {format_bytes(nbytes)}" for fmt, (_, nbytes) in sorted(formats.items(), key=lambda kv: -kv[1][1])]
    return parts[0] if len(parts) == 1 else " + ".join(parts) + f" = {format_bytes(w['bytes_loaded'])}"
