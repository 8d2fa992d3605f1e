"""The trace: one event per lifecycle phase, as plain data, plus a rich renderer.

Events are dataclasses ``(phase, start, duration, data)`` collected by a :class:`Tracer`. The rich
renderer is one consumer (terminal and Jupyter); ``Tracer.events`` is the same data for plots.
Lifecycle functions take ``tracer=None`` and then do no tracing work at all.

Phases, in the order a request meets them: ``load`` -> ``prepare`` -> ``tokenize`` -> ``prefill``
-> ``decode`` (one per step) -> ``stop`` -> ``summary``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .metrics import format_bytes

VERBOSITY = ("quiet", "summary", "steps", "full")


@dataclass
class TraceEvent:
    """One phase: ``start`` is seconds since the tracer was made, ``duration`` seconds."""

    phase: str
    start: float
    duration: float
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=_jsonable)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "value"):  # enums such as StopReason
        return value.value
    return str(value)


class Tracer:
    """Collects :class:`TraceEvent` s and, given a console, renders each as it arrives.

    Args:
        console: a ``rich.console.Console`` to print to, or None to only collect.
        verbosity: ``quiet`` (nothing printed), ``summary`` (load, stop, summary), ``steps``
            (every phase; long decode runs fold to every ``fold_every``-th step plus the last),
            ``full`` (every phase and every step).
        fold_every: with ``steps``, print decode steps 1..5, then every Nth, then the last.
    """

    def __init__(self, console: Console | None = None, verbosity: str = "steps", fold_every: int = 10):
        if verbosity not in VERBOSITY:
            raise ValueError(f"verbosity must be one of {VERBOSITY}, got {verbosity!r}")
        self.console = console
        self.verbosity = verbosity
        self.fold_every = fold_every
        self.t0 = time.perf_counter()
        self.events: list[TraceEvent] = []

    def now(self) -> float:
        """Seconds since this tracer was made."""
        return time.perf_counter() - self.t0

    def emit(self, phase: str, start: float, duration: float, **data: Any) -> TraceEvent:
        """Record an event (``start`` in :meth:`now` seconds) and render it."""
        event = TraceEvent(phase, start, duration, data)
        self.events.append(event)
        if self.console is not None and self.verbosity != "quiet":
            render_event(self.console, event, self)
        return event

    def to_jsonl(self) -> str:
        """All events as JSON lines (one event per line)."""
        return "\n".join(e.to_json() for e in self.events) + "\n"


# --- rendering ---------------------------------------------------------------------------------
def visible(piece: str) -> str:
    """Make whitespace visible in a token piece: space -> '␣', newline -> '↵', tab -> '⇥'."""
    return piece.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, escape(str(value)))
    return table


def _render_load(console: Console, e: TraceEvent) -> None:
    d = e.data
    console.rule(f"[bold]load[/] {escape(d['name'])}  ({e.duration:.2f} s)")
    console.print(f"source: [green]{d['source']}[/]  folder: {escape(str(d['path']))}")
    for note in d.get("notes", []):
        console.print(f"  note: {escape(note)}")
    console.print(_kv_table("config", list(d["config"].items())))
    w = d["weights"]
    rows = [("parameters", f"{w['parameters']:,}"), ("as loaded", f"float32, {format_bytes(w['bytes_loaded'])}")]
    rows += [(f"stored {k}", f"{n:,} params, {format_bytes(w['bytes_stored'][k])}") for k, n in w["stored"].items()]
    if w.get("unused"):
        rows.append(("unused tensors", ", ".join(w["unused"])))
    console.print(_kv_table("weights", rows))
    t = d["tokenizer"]
    console.print(_kv_table("tokenizer", [("vocab", f"{t['vocab_size']:,}"), ("special", t["special"]),
                                           ("eos ids", t["eos_ids"])]))
    steps = ", ".join(f"{k} {v:.2f} s" for k, v in d["seconds"].items())
    console.print(f"seconds per step: {steps}")


def _render_prepare(console: Console, e: TraceEvent) -> None:
    d = e.data
    console.rule("[bold]request[/] " + ("chat template" if d["chat"] else "completion"))
    if d["chat"]:
        for m in d["messages"]:
            console.print(f"[magenta]{m['role']}[/]: {escape(m['content'])}")
    text = Text(d["text"])
    for special in d.get("special_tokens", []):
        text.highlight_words([special], style="bold yellow")
    console.print(Text("text the model reads:", style="bold"))
    console.print(text)


def _render_tokenize(console: Console, e: TraceEvent) -> None:
    d = e.data
    console.rule(f"[bold]tokenize[/] {len(d['ids'])} tokens  ({e.duration * 1e3:.1f} ms)")
    table = Table(box=None, padding=(0, 1))
    table.add_column("pos", justify="right")
    table.add_column("id", justify="right")
    table.add_column("piece")
    for pos, (tid, piece) in enumerate(zip(d["ids"], d["pieces"])):
        style = "bold yellow" if tid in d.get("special_ids", ()) else ""
        table.add_row(str(pos), str(tid), Text(visible(piece), style=style))
    console.print(table)


def _candidates_text(cands: list[tuple[str, float]]) -> str:
    return "  ".join(f"{visible(p)!s}:{prob:.2f}" for p, prob in cands)


def _render_prefill(console: Console, e: TraceEvent) -> None:
    d = e.data
    console.rule(f"[bold]prefill[/] {d['tokens']} tokens in {e.duration:.3f} s  "
                 f"({d['tokens'] / e.duration:,.0f} tokens/s)")
    console.print(f"KV entries written: {d['layers']} layers x {d['tokens']} positions "
                  f"= {d['layers'] * d['tokens']:,} (k and v), cache length {d['cache_length']}")
    console.print("first-token candidates: " + escape(_candidates_text(d["candidates"])))
    console.print(f"[dim]{'step':>4} {'pos':>5}  {'token':<16} {'prob':>5}  {'ms':>7}  alternatives[/]")


def _render_decode(console: Console, e: TraceEvent, tracer: Tracer) -> None:
    d = e.data
    step, last = d["step"], d.get("last", False)
    if tracer.verbosity == "summary":
        return
    if tracer.verbosity == "steps" and not (step <= 5 or step % tracer.fold_every == 0 or last):
        return
    alts = _candidates_text(d["candidates"][1:] if d["candidates"] else [])
    console.print(
        f"{step:>4} {d['position']:>5}  {escape(visible(d['piece'])):<16} {d['prob']:>5.2f}  "
        f"{e.duration * 1e3:>7.1f}  [dim]{escape(alts)}[/]", highlight=False
    )


def _render_stop(console: Console, e: TraceEvent) -> None:
    d = e.data
    console.rule(f"[bold]stop[/]: {d['reason']}")
    if d.get("detail"):
        console.print(escape(d["detail"]))
    console.print(Text("output: ", style="bold") + Text(d["text"]))


def _render_summary(console: Console, e: TraceEvent) -> None:
    m = e.data
    table = Table(title="summary", title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan")
    table.add_column(justify="right")
    rows = [
        ("load", f"{m['load_s']:.2f} s") if m.get("load_s") is not None else None,
        ("prompt tokens", f"{m['prompt_tokens']}"),
        ("new tokens", f"{m['new_tokens']}"),
        ("TTFT", f"{m['ttft_s'] * 1e3:.1f} ms"),
        ("TPOT mean / p50 / p90", f"{m['tpot_s'] * 1e3:.1f} / {m['tpot_p50_s'] * 1e3:.1f} / "
                                   f"{m['tpot_p90_s'] * 1e3:.1f} ms"),
        ("prefill", f"{m['prefill_tokens_per_s']:,.0f} tokens/s"),
        ("decode", f"{m['decode_tokens_per_s']:,.1f} tokens/s"),
        ("total", f"{m['total_s']:.2f} s"),
        ("KV cache per token", format_bytes(m["kv_bytes_per_token"])),
        ("KV cache this request", f"{format_bytes(m['kv_bytes_used'])} used of "
                                  f"{format_bytes(m['kv_bytes_reserved'])} reserved"),
    ]
    for row in rows:
        if row is not None:
            table.add_row(*row)
    console.rule("[bold]summary")
    console.print(table)


def render_event(console: Console, event: TraceEvent, tracer: Tracer) -> None:
    """Print one event with rich, as its phase deserves."""
    brief = tracer.verbosity == "summary"
    if event.phase == "load":
        _render_load(console, event)
    elif event.phase == "prepare" and not brief:
        _render_prepare(console, event)
    elif event.phase == "tokenize" and not brief:
        _render_tokenize(console, event)
    elif event.phase == "prefill" and not brief:
        _render_prefill(console, event)
    elif event.phase == "decode":
        _render_decode(console, event, tracer)
    elif event.phase == "stop":
        _render_stop(console, event)
    elif event.phase == "summary":
        _render_summary(console, event)
