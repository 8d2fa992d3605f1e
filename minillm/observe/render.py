"""The rich renderer of trace events: what a student reads in a terminal or a notebook.

Each phase has one small function (the summary's tables are in ``render_summary.py``). The streamed
text shows in a rich ``Live`` view at the bottom of a terminal while the step lines print above it;
piped output gets the text at the stop event.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from minillm.observe.metrics import format_bytes
from minillm.observe.render_summary import print_summary
from minillm.observe.trace_event import TraceEvent

#: A prompt's token table shows this many rows at each end unless verbosity is "full".
TOKEN_ROWS_SHOWN = 10
#: A message longer than this (characters; an attached document) is printed once: with the messages,
#: and folded in "text the model reads", unless verbosity is "full".
FOLD_MESSAGE_CHARS = 300


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, escape(str(value)))
    return table


def _candidates_text(cands: list[tuple[str, float]]) -> str:
    return "  ".join(f"{p}:{prob:.2f}" for p, prob in cands)


class Renderer:
    """Prints each event with rich as it arrives; keeps the Live view of the streamed text.

    ``verbosity`` and ``fold_every``: the ``events.Tracer``'s (which events and decode steps to print).
    """

    def __init__(self, console: Console, verbosity: str, fold_every: int, live: bool = False):
        self.console = console
        self.verbosity, self.fold_every = verbosity, fold_every
        self.use_live = live
        self.live: Live | None = None
        self.text = ""
        self.folded = 0  # decode steps not printed since the last printed one

    # --- streamed text --------------------------------------------------------------------------
    def stream_text(self, delta: str) -> None:
        self.text += delta
        if not self.use_live:
            return
        if self.live is None:
            self.live = Live(console=self.console, auto_refresh=False, transient=True)
            self.live.start()
        self.live.update(Text("streaming: ", style="bold green") + Text(self.text), refresh=True)

    def _end_live(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    # --- events ---------------------------------------------------------------------------------
    def render(self, e: TraceEvent) -> None:
        brief = self.verbosity == "summary"
        method = getattr(self, f"_{e.phase}", None)
        if method is None or (brief and e.phase in ("warmup", "prepare", "tokenize", "prefill", "decode")):
            return
        if e.phase in ("stop", "summary"):
            self._end_live()
            if self.folded:
                self.console.print(f"[dim]   … {self.folded} steps folded (-v full shows every step)[/]")
                self.folded = 0
        method(e)

    def _load(self, e: TraceEvent) -> None:
        c, d = self.console, e.data
        c.rule(f"[bold]load[/] {escape(d['name'])}  ({e.duration:.2f} s)")
        c.print(f"source: [green]{d['source']}[/]  folder: {escape(str(d['path']))}")
        for note in d.get("notes", []):
            c.print(f"  note: {escape(note)}")
        c.print(_kv_table("config", list(d["config"].items())))
        w = d["weights"]
        how = "memory-mapped, paged in on first use" if w.get("mapped") else "in memory"
        rows = [
            ("parameters", f"{w['parameters']:,}"),
            ("held as", f"{_held(w)}, {how}"),
        ]
        rows += [(f"stored {k}", f"{n:,} params, {format_bytes(w['bytes_stored'][k])}") for k, n in w["stored"].items()]
        if w.get("seconds"):
            rows.append(("seconds", ", ".join(f"{k} {v:.2f}" for k, v in w["seconds"].items())))
        if w.get("unused"):
            rows.append(("unused tensors", ", ".join(w["unused"])))
        c.print(_kv_table("weights", rows))
        t = d["tokenizer"]
        c.print(
            _kv_table(
                "tokenizer", [("vocab", f"{t['vocab_size']:,}"), ("special", t["special"]), ("eos ids", t["eos_ids"])]
            )
        )
        for a in d.get("adapters", []):  # LoRA: W' = W + scaling * (B A)^T, merged or computed apart
            c.print(
                _kv_table(
                    f"LoRA adapter {a['name']} ({a['mode']})",
                    [
                        ("rank, alpha", f"r={a['rank']}, alpha={a['alpha']:g}"),
                        ("scaling", f"{a['scaling']:.4g} (alpha / {'sqrt(r), rsLoRA' if a['rslora'] else 'r'})"),
                        ("targets", f"{', '.join(a['targets'])} in {a['layers']} layers ({a['modules']} modules)"),
                        (
                            "adds",
                            f"{a['parameters']:,} params, {format_bytes(a['bytes'])}"
                            + (" (folded into the weights)" if a["mode"] == "merged" else " (kept beside the weights)"),
                        ),
                        ("load", f"{a['seconds']:.2f} s"),
                    ],
                )
            )
        c.print("seconds per step: " + ", ".join(f"{k} {v:.2f}" for k, v in d["seconds"].items()))
        for blas in d.get("blas", []):
            c.print(f"BLAS: {escape(blas)}")
        if k := d.get("kernels"):
            c.print(f"kernels: {escape(k['name'])} ({escape(k['source'])})")

    def _attach(self, e: TraceEvent) -> None:
        d = e.data
        self.console.print(
            f"[bold]attached[/]: {escape(d['name'])}, {d['chars']:,} characters = {d['tokens']:,} tokens "
            "(in the user message, before the prompt)"
        )

    def _warmup(self, e: TraceEvent) -> None:
        d = e.data
        cal = d.get("calibration") or {}
        calibrated = ""  # the diagnosis's rates, measured now (once per machine) rather than in a request
        if cal.get("measured_now"):
            kept = " (a busy machine: kept for this process only)" if cal.get("busy") else ""
            calibrated = f"; this machine calibrated for the diagnosis in {cal['seconds']:.1f} s{kept}"
        self.console.print(
            f"[bold]warm-up[/]: {d['tokens']} tokens + {d['decode_steps']} decode steps in "
            f"{e.duration:.2f} s (reported apart from requests){calibrated} -> [bold green]ready[/]"
        )

    def _prepare(self, e: TraceEvent) -> None:
        c, d = self.console, e.data
        c.rule("[bold]request[/] " + ("chat template" if d["chat"] else "completion"))
        for m in d["messages"]:
            c.print(f"[magenta]{m['role']}[/]: {escape(m['content'])}")
        text = self._model_text(d)
        for special in d.get("special_tokens", []):
            text.highlight_words([special], style="bold yellow")  # role delimiters, generation marker
        c.print(Text("text the model reads:", style="bold"))
        c.print(text)

    def _model_text(self, d: dict) -> Text:
        """The text the model reads; a long message (an attached document), shown just above, is
        folded here unless verbosity is "full", so the document is printed once."""
        raw, text, pos = d["text"], Text(), 0
        for m in d["messages"] if self.verbosity != "full" else ():
            content = m.get("content")
            if not isinstance(content, str) or len(content) <= FOLD_MESSAGE_CHARS:
                continue
            i = raw.find(content, pos)
            if i < 0:  # the template changed it (stripped, escaped): shown as it is
                continue
            text.append(raw[pos:i])
            text.append(f"[the {m['role']} message above, {len(content):,} characters; -v full shows it here]", "dim")
            pos = i + len(content)
        text.append(raw[pos:])
        return text

    def _tokenize(self, e: TraceEvent) -> None:
        d = e.data
        self.console.rule(f"[bold]tokenize[/] {len(d['ids'])} tokens  ({e.duration * 1e3:.1f} ms)")
        table = Table(box=None, padding=(0, 1))
        for col, justify in (("pos", "right"), ("id", "right"), ("piece", "left")):
            table.add_column(col, justify=justify)
        specials = set(d.get("special_ids", ()))
        rows = list(enumerate(zip(d["ids"], d["pieces"], strict=True)))
        folded = 0
        if self.verbosity != "full" and len(rows) > 2 * TOKEN_ROWS_SHOWN + 1:  # a long prompt: its ends
            folded = len(rows) - 2 * TOKEN_ROWS_SHOWN
            rows = rows[:TOKEN_ROWS_SHOWN] + [None] + rows[-TOKEN_ROWS_SHOWN:]
        for row in rows:
            if row is None:
                table.add_row("", "", Text(f"… {folded:,} tokens folded (-v full shows every token)", style="dim"))
                continue
            pos, (tid, piece) = row
            table.add_row(str(pos), str(tid), Text(piece, style="bold yellow" if tid in specials else ""))
        self.console.print(table)

    def _prefill(self, e: TraceEvent) -> None:
        c, d = self.console, e.data
        c.rule(
            f"[bold]prefill[/] {d['tokens']} tokens in {e.duration:.3f} s  "
            f"({d['tokens'] / max(e.duration, 1e-9):,.0f} tokens/s)"
        )
        c.print(
            f"KV entries written: {d['layers']} layers x {d['tokens']} positions "
            f"= {d['layers'] * d['tokens']:,} (k and v), cache length {d['cache_length']}"
        )
        masks = d.get("masks") or {}
        if "full_attention" in masks:
            c.print("causal mask (row = query position, ■ = may attend):")
            c.print(Text(masks["full_attention"], style="dim"))
        if "sliding_attention" in masks:
            c.print(
                f"sliding-window mask, window {d['sliding_window']} ({d['sliding_layers']} of {d['layers']} "
                "layers; each query sees itself and the window - 1 positions before it):"
            )
            c.print(Text(masks["sliding_attention"], style="dim"))
        c.print("first-token candidates: " + escape(_candidates_text(d["candidates"])))
        if self.verbosity != "summary":
            c.print("[dim]each decode step feeds one token at position pos and samples the next:[/]")
            c.print(
                f"[dim]{'step':>4} {'pos':>5}  {'input':>14} -> {'output':<14} {'prob':>5}  {'ms':>7}  "
                "other candidates[/]"
            )

    def _decode(self, e: TraceEvent) -> None:
        d = e.data
        step, last = d["step"], d.get("last", False)
        if self.verbosity == "steps" and not (step <= 5 or step % self.fold_every == 0 or last):
            self.folded += 1
            return
        if self.folded:
            self.console.print(f"[dim]   … {self.folded} steps folded (-v full shows every step)[/]")
            self.folded = 0
        alts = _candidates_text([c for c in d["candidates"] if c[0] != d["piece"]][:4])
        self.console.print(
            f"{step:>4} {d['position']:>5}  {escape(d['input_piece']):>14} -> "
            f"{escape(d['piece']):<14} {d['prob']:>5.2f}  {e.duration * 1e3:>7.1f}  [dim]{escape(alts)}[/]",
            highlight=False,
            no_wrap=True,
            overflow="ellipsis",
        )

    def _mask(self, e: TraceEvent) -> None:
        """A constraint's mask: every step at -v full, else only the steps that forced a run."""
        d = e.data
        if not d["forced"] and self.verbosity != "full":
            return
        few = " ".join(d["allowed_pieces"]) if d["allowed"] <= 8 else ""
        forced = f"; forced run of {len(d['forced'])}: {''.join(d['forced_pieces'])}" if d["forced"] else ""
        self.console.print(
            f"[dim]mask: {d['allowed']:,} of {d['vocab']:,} ids allowed {escape(few)} ({e.duration * 1e3:.2f} ms)"
            f" -> {escape(d['piece'])}{escape(forced)}[/]",
            highlight=False,
        )

    def _verify(self, e: TraceEvent) -> None:
        """One line per verification: drafted pieces (kept ones bold), the token after them, the rates."""
        if (d := e.data) and self.verbosity == "summary":
            return
        pieces = [f"[bold]{escape(p)}[/]" if j < d["accepted"] else f"[strike dim]{escape(p)}[/]"
                  for j, p in enumerate(d["drafted"])]  # fmt: skip
        how = "bonus" if d["bonus"] else "resampled"
        line = f"  verify  {' '.join(pieces)}  {d['accepted']}/{len(d['drafted'])} kept, {how} {escape(d['token'])}  "
        rates = f"[dim]α {d['acceptance_rate']:.2f}, {d['tokens_per_pass']:.2f} tokens per pass[/]"
        self.console.print(line + rates, highlight=False, no_wrap=True, overflow="ellipsis")

    def _batch_step(self, e: TraceEvent) -> None:
        """One line per scheduler step; the block tables and the pool when requests joined or left."""
        c, d = self.console, e.data
        if self.verbosity == "summary":
            return
        fed = "  ".join(
            f"r{r['request']}:"
            + (f"{r['tokens']}@{r['start']}" if r["kind"] == "prefill" else f"d@{r['start']}")
            + ("(re)" if r["recompute"] else "")
            for r in d["rows"]
        )
        notes = []
        if d["prefix_hits"]:
            notes.append("prefix hits " + ", ".join(f"r{r} {t} tokens" for r, t in d["prefix_hits"].items()))
        if d["preempted"]:
            notes.append("[bold red]preempted[/] " + ", ".join(f"r{r}" for r in d["preempted"]))
        if d["finished"]:
            notes.append("finished " + ", ".join(f"r{r}" for r in d["finished"]))
        c.print(
            f"step {d['step']:>4}  {len(d['rows']):>3} req {d['tokens']:>4} tok  blocks {d['blocks_used']}/"
            f"{d['blocks_total']} (cached free {d['cached_free']})  {escape(fed)}  " + "  ".join(notes),
            highlight=False,
            no_wrap=True,
            overflow="ellipsis",
        )
        if self.verbosity == "full" or d["admitted"] or d["preempted"] or d["finished"]:
            if d["table_picture"]:
                c.print(Text(d["table_picture"], style="dim"))
            c.print(Text(d["pool_picture"], style="dim"))

    def _stop(self, e: TraceEvent) -> None:
        c, d = self.console, e.data
        c.rule(f"[bold]stop[/]: {d['reason']}")
        if d.get("detail"):
            c.print(escape(d["detail"]))
        c.print(Text("output: ", style="bold") + Text(d["text"]))

    def _summary(self, e: TraceEvent) -> None:
        print_summary(self.console, e.data)


def _held(w: dict) -> str:
    """The weights as held in memory, by format: ``float32 513.1 MiB``, or for ``weight_dtype="int8"``
    ``int8 103.9 MiB + float32 25.3 MiB = 129.2 MiB`` (norms, and what the format leaves float32)."""
    held = w.get("held") or {"float32": [w["parameters"], w["bytes_loaded"]]}
    parts = [f"{fmt} {format_bytes(nbytes)}" for fmt, (_, nbytes) in sorted(held.items(), key=lambda kv: -kv[1][1])]
    return parts[0] if len(parts) == 1 else " + ".join(parts) + f" = {format_bytes(w['bytes_loaded'])}"
