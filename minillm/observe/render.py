"""The rich renderer of trace events: what a student reads in a terminal or a notebook.

One rule (a heading across the terminal) per phase of lesson 1's lifecycle, in its order::

    load -> request -> tokenize -> prefill (+ the first sample) -> decode (decode_step + sample,
    a row per step) -> detokenize -> stop -> free -> summary

Verbosity ``steps`` (the default) is compact: a short request fits one projector screen (about
40 lines at 100 columns). ``full`` adds the model's config, weights and tokenizer tables, every
prompt token as a row, the causal mask, every decode step, the memory tables and the diagnosis's
calibration. ``summary`` keeps load, detokenize, stop, free and the summary. The load and summary
sections are in ``render_load.py`` and ``render_summary.py``.

The streamed text shows in a rich ``Live`` view at the bottom of a real terminal while the step
lines print above it; elsewhere (a pipe, a file, a notebook, even with colours forced) the text is
printed once, under the detokenize rule.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from minillm.observe.metrics import format_bytes
from minillm.observe.render_load import print_load
from minillm.observe.render_summary import print_summary
from minillm.observe.trace_event import TraceEvent

#: A prompt's tokens: this many at each end unless verbosity is "full".
TOKEN_ROWS_SHOWN = 10
#: A message longer than this (characters; an attached document) is printed once: with the messages,
#: and folded in "text the model reads", unless verbosity is "full".
FOLD_MESSAGE_CHARS = 300
#: The decode table's header: each row is one decode_step (the token fed at pos) and one sample.
DECODE_HEADER = f"{'step':>4} {'pos':>5}  {'fed':>14} -> {'sampled':<14} {'prob':>5}  {'ms':>7}  other candidates"
#: What the request's end did with its KV cache (the stop event's ``cache``).
CACHE_FATE = {
    "freed": "freed",
    "emptied": "emptied for the caller's next request (its memory stays allocated)",
    "kept": "kept for the conversation's next turn",
}


def on_a_terminal(console: Console) -> bool:
    """True when ``console`` writes to a real terminal, where a Live view can redraw in place.

    rich's ``is_terminal`` is also True when colours are forced (``FORCE_COLOR``, ``TTY_COMPATIBLE``)
    into a pipe or a file; there every redraw of a Live view would stay in the output as one more line.
    """
    isatty = getattr(console.file, "isatty", None)
    try:
        return bool(console.is_terminal and not console.is_dumb_terminal and isatty is not None and isatty())
    except ValueError:  # a closed file
        return False


def _candidates_text(cands: list[tuple[str, float]]) -> str:
    return "  ".join(f"{p}:{prob:.2f}" for p, prob in cands)


class Renderer:
    """Prints each event with rich as it arrives; keeps the Live view of the streamed text.

    ``verbosity`` and ``fold_every``: the ``events.Tracer``'s (which events and decode steps to print);
    ``live``: show the streamed text in a Live view (only on a real terminal: :func:`on_a_terminal`).
    """

    def __init__(self, console: Console, verbosity: str, fold_every: int, live: bool = False):
        self.console = console
        self.verbosity, self.fold_every = verbosity, fold_every
        self.full = verbosity == "full"
        self.use_live = live
        self.live: Live | None = None
        self.text = ""
        self.folded = 0  # decode steps not printed since the last printed one
        self.prefilled = self.decoding = False  # this request's prefill / decode rule printed
        self.cache_fate = "freed"  # the last stop event's: what the request did with its KV cache

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

    def _end_folded(self) -> None:
        if self.folded:
            steps = f"{self.folded} step{'s' if self.folded > 1 else ''}"
            self.console.print(f"[dim]   … {steps} folded (-v full shows every step)[/]")
            self.folded = 0

    # --- events ---------------------------------------------------------------------------------
    def render(self, e: TraceEvent) -> None:
        brief = self.verbosity == "summary"
        method = getattr(self, f"_{e.phase}", None)
        if method is None or (brief and e.phase in ("warmup", "prepare", "tokenize", "prefill", "decode")):
            return
        if e.phase in ("stop", "summary"):
            self._end_live()
            self._end_folded()
        method(e)

    def _load(self, e: TraceEvent) -> None:
        print_load(self.console, e.data, e.duration, self.full)

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
        self.prefilled = self.decoding = False  # a new request (a conversation's next turn)
        self.text = ""
        c.rule("[bold]request[/] " + ("chat template" if d["chat"] else "completion"))
        for m in d["messages"]:
            c.print(f"[magenta]{m['role']}[/]: {escape(m['content'])}")
        text = self._model_text(d)
        for special in d.get("special_tokens", []):
            text.highlight_words([special], style="bold yellow")  # role delimiters, generation marker
        c.print(Text("text the model reads: ", style="bold") + text)

    def _model_text(self, d: dict) -> Text:
        """The text the model reads; a long message (an attached document), shown just above, is
        folded here unless verbosity is "full", so the document is printed once."""
        raw, text, pos = d["text"], Text(), 0
        for m in d["messages"] if not self.full else ():
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
        specials = set(d.get("special_ids", ()))
        tokens = [(pos, tid, Text(piece, style="bold yellow" if tid in specials else ""))
                  for pos, (tid, piece) in enumerate(zip(d["ids"], d["pieces"], strict=True))]  # fmt: skip
        if self.full:  # a row per token
            table = Table(box=None, padding=(0, 1))
            for col, justify in (("pos", "right"), ("id", "right"), ("piece", "left")):
                table.add_column(col, justify=justify)
            for pos, tid, piece in tokens:
                table.add_row(str(pos), str(tid), piece)
            self.console.print(table)
            return
        if len(tokens) <= 2 * TOKEN_ROWS_SHOWN + 1:
            self._token_columns(tokens)
            return
        self._token_columns(tokens[:TOKEN_ROWS_SHOWN])  # a long prompt: its ends
        folded = len(tokens) - 2 * TOKEN_ROWS_SHOWN
        self.console.print(f"[dim]  … {folded:,} tokens folded (-v full shows every token)[/]")
        self._token_columns(tokens[-TOKEN_ROWS_SHOWN:])

    def _token_columns(self, tokens: list[tuple[int, int, Text]]) -> None:
        """The tokens as columns, three lines (pos, id, piece) per screen width::

          pos  0    1         2    3        4
           id  504  3575      282  4649     314
        piece  The  ␣capital  ␣of  ␣France  ␣is
        """
        labels = ("  pos", "   id", "piece")
        room = max(self.console.width, 20)
        lines = [Text(label) for label in labels]
        for pos, tid, piece in tokens:
            cells = (Text(str(pos)), Text(str(tid)), piece)
            width = max(cell_len(cell.plain) for cell in cells)
            if len(lines[0]) > 5 and len(lines[0]) + 2 + width > room:  # the screen is full: print, go on
                self._print_lines(lines)
                lines = [Text(label) for label in labels]
            for line, cell in zip(lines, cells, strict=True):
                line.append("  ")
                line.append_text(cell)
                line.append(" " * (width - cell_len(cell.plain)))
        self._print_lines(lines)

    def _print_lines(self, lines: list[Text]) -> None:
        for line in lines:
            line.rstrip()
            self.console.print(line, no_wrap=True, overflow="crop")

    def _prefill(self, e: TraceEvent) -> None:
        c, d = self.console, e.data
        self.prefilled = True
        c.rule(
            f"[bold]prefill[/] {d['tokens']} tokens in {e.duration:.3f} s  "
            f"({d['tokens'] / max(e.duration, 1e-9):,.0f} tokens/s)"
        )
        c.print(
            f"KV entries written: {d['layers']} layers x {d['tokens']} positions "
            f"= {d['layers'] * d['tokens']:,} (k and v), cache length {d['cache_length']}"
        )
        masks = d.get("masks") or {}
        if "full_attention" in masks and self.full:
            c.print("causal mask (row = query position, ■ = may attend):")
            c.print(Text(masks["full_attention"], style="dim"))
        if "sliding_attention" in masks and self.full:
            c.print(
                f"sliding-window mask, window {d['sliding_window']} ({d['sliding_layers']} of {d['layers']} "
                "layers; each query sees itself and the window - 1 positions before it):"
            )
            c.print(Text(masks["sliding_attention"], style="dim"))
        c.print("first-token candidates: " + escape(_candidates_text(d["candidates"])))
        if "piece" in d:
            prob = d.get("prob", float("nan"))
            p = "" if prob != prob else f", p {prob:.2f}"  # NaN: no distribution was reported
            c.print(f"[bold]sample[/]: {escape(d['piece'])} (id {d['token']}{p}), the first new token (TTFT ends here)")

    def _decode_rule(self) -> None:
        """The decode rule and its table's header, before the request's first decode step."""
        if self.decoding or self.verbosity == "summary":
            return
        self.decoding = True
        self.console.rule("[bold]decode[/]  a step = decode_step (feed one token at pos) + sample (the next)")
        self.console.print(f"[dim]{DECODE_HEADER}[/]", highlight=False)

    def _decode(self, e: TraceEvent) -> None:
        d = e.data
        self._decode_rule()
        step, last = d["step"], d.get("last", False)
        if not self.full and not (step <= 5 or step % self.fold_every == 0 or last):
            self.folded += 1
            return
        self._end_folded()
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
        if not d["forced"] and not self.full:
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
        self._decode_rule()
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
        if self.full or d["admitted"] or d["preempted"] or d["finished"]:
            if d["table_picture"]:
                c.print(Text(d["table_picture"], style="dim"))
            c.print(Text(d["pool_picture"], style="dim"))

    def _stop(self, e: TraceEvent) -> None:
        """Three of lesson 1's phases end the request: detokenize (the text), stop (why), and at the
        summary, free (what became of the KV cache)."""
        c, d = self.console, e.data
        if self.prefilled and not self.decoding and self.verbosity != "summary":
            c.rule("[bold]decode[/]  no step: the request ended at its first token", style="dim")
        self.prefilled = self.decoding = False
        self.cache_fate = d.get("cache", "freed")
        n = d.get("new_tokens")
        ids = "" if n is None else f"{n} new id{'' if n == 1 else 's'} -> "
        c.rule(f"[bold]detokenize[/] {ids}{len(d['text']):,} characters")
        c.print(Text("output: ", style="bold") + Text(d["text"]))
        c.rule(f"[bold]stop[/]: {d['reason']}")
        if d.get("detail"):
            c.print(escape(d["detail"]))

    def _summary(self, e: TraceEvent) -> None:
        m = e.data
        per, used, reserved = m["kv_bytes_per_token"], m["kv_bytes_used"], m["kv_bytes_reserved"]
        self.console.rule("[bold]free[/]")
        if per:
            self.console.print(
                f"KV cache {CACHE_FATE.get(self.cache_fate, self.cache_fate)}: {reserved // per:,} positions x "
                f"{format_bytes(per)} ({m.get('kv_dtype', 'float32')}) = {format_bytes(reserved)}, "
                f"{used // per:,} written; the model stays loaded"
            )
        print_summary(self.console, m, full=self.full)
