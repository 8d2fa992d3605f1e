"""The trace: one event per lifecycle phase, as plain data.

The runtime tells a listener what happened (``on_event(phase, start, duration, model, facts)``);
a :class:`Tracer` is such a listener. It turns the facts into plain data (``describe.py``) and
keeps them as :class:`TraceEvent` s ``(phase, start, duration, data)``. The rich renderer
(``render.py``, terminal and Jupyter) is one consumer; ``Tracer.events``, the JSON lines of
:meth:`Tracer.to_jsonl` and :func:`plot_timeline` are others. With no tracer, the runtime does
no tracing work at all.

Phases, in the order a request meets them::

    load -> warmup -> prepare -> tokenize -> prefill -> decode (one per step) -> stop -> summary

(``minillm chat --file`` adds an ``attach`` event before ``prepare``: the document's size in tokens.)
Many requests at once (``generate_batch``): one ``batch_step`` per scheduler step instead.
"""

from __future__ import annotations

import time
from typing import Any

from minillm.observe import describe
from minillm.observe.metrics import cpu_snapshot, others_cpu_share
from minillm.observe.render import Renderer, on_a_terminal
from minillm.observe.trace_event import TraceEvent

VERBOSITY = ("quiet", "summary", "steps", "full")
PHASES = (
    "load",
    "warmup",
    "prepare",
    "tokenize",
    "prefill",
    "mask",
    "decode",
    "verify",
    "stop",
    "summary",
    "batch_step",
)
#: The phases whose events hold none of a request's text (prompt, tokens, answer): what a tracer made
#: with ``hide_text=True`` prints (a server's console without ``--log-prompts``).
TEXT_FREE_PHASES = ("load", "warmup", "summary", "batch_step")


class Tracer:
    """Collects :class:`TraceEvent` s and, given a console, renders each as it arrives.

    Args:
        console: a ``rich.console.Console`` to print to, or None to only collect.
        verbosity: ``quiet`` (nothing printed), ``summary`` (load, detokenize, stop, free,
            summary), ``steps`` (every phase, compact: decode steps 1-5, every ``fold_every``-th
            and the last; a short request fits one screen), ``full`` (every phase and every step,
            with the config, tokenizer and memory tables; ``render.py``).
        fold_every: see ``steps``.
        live: show the streamed text in a rich Live view at the bottom of a terminal (default:
            only when the console writes to a real terminal, ``render.on_a_terminal``; a pipe, a
            file or a notebook, colours forced or not, gets the text once, at the stop event).
        hide_text: print only the phases in :data:`TEXT_FREE_PHASES` (every event is still kept).
    """

    def __init__(
        self,
        console=None,
        verbosity: str = "steps",
        fold_every: int = 10,
        live: bool | None = None,
        hide_text: bool = False,
    ):
        if verbosity not in VERBOSITY:
            raise ValueError(f"verbosity must be one of {VERBOSITY}, got {verbosity!r}")
        self.console = console
        self.verbosity = verbosity
        self.fold_every = fold_every
        self.hide_text = hide_text
        self.t0 = time.perf_counter()
        self.events: list[TraceEvent] = []
        self._renderer = None
        self._cpu_at_start = None
        self._cpu_at_creation = cpu_snapshot()  # a tracer made before load measures others' share over it
        self._load_share = float("nan")
        if console is not None and verbosity != "quiet":
            live = on_a_terminal(console) if live is None else live  # not a pipe with colours forced
            self._renderer = Renderer(console, verbosity, fold_every, live=live)

    def on_event(self, phase: str, start: float, duration: float, model, facts: dict[str, Any]) -> None:
        """What the runtime calls: ``start`` in ``time.perf_counter()`` seconds, ``duration``
        seconds, ``facts`` as the runtime reports them; ``model`` gives the context (tokenizer,
        config) to describe them with."""
        if phase == "text":  # a streamed text delta: shown live, carried as data by the decode events
            if self._renderer is not None and not self.hide_text:
                self._renderer.stream_text(facts["text"])
            return
        if phase == "prepare":
            self._cpu_at_start = cpu_snapshot()  # to measure other processes' share during the request
        if phase == "load":  # others' share while loading (from this tracer's creation: made before load)
            self._load_share = others_cpu_share(self._cpu_at_creation, cpu_snapshot())
            facts = {**facts, "others_cpu_share": self._load_share}
        if phase == "summary":
            facts = {
                **facts,
                "others_cpu_share": others_cpu_share(self._cpu_at_start, cpu_snapshot())
                if self._cpu_at_start
                else float("nan"),
                "load_others_cpu_share": self._load_share,
            }
        self.emit(phase, start - self.t0, duration, **getattr(describe, phase)(model, **facts))

    def now(self) -> float:
        """Seconds since this tracer was made."""
        return time.perf_counter() - self.t0

    def emit(self, phase: str, start: float, duration: float, **data: Any) -> TraceEvent:
        """Record an event (``start`` in :meth:`now` seconds, ``duration`` seconds) and render it."""
        event = TraceEvent(phase, start, duration, data)
        self.events.append(event)
        if self._renderer is not None and (not self.hide_text or phase in TEXT_FREE_PHASES):
            self._renderer.render(event)
        return event

    def to_jsonl(self) -> str:
        """All events as JSON lines (one event per line)."""
        return "".join(e.to_json() + "\n" for e in self.events)

    @staticmethod
    def from_jsonl(text: str) -> list[TraceEvent]:
        """Parse :meth:`to_jsonl` output back into events."""
        return [TraceEvent.from_json(line) for line in text.splitlines() if line.strip()]


def plot_timeline(events: list[TraceEvent], ax=None):
    """A timeline (matplotlib) of one request: one bar per phase, decode steps side by side.

    Args:
        events: a tracer's events (or parsed JSON lines).
        ax: a matplotlib Axes to draw on (default: a new figure).

    Returns:
        The Axes. Bars span ``[start, start + duration]`` in seconds since the tracer began.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.8))
    colors = {
        "load": "tab:gray",
        "warmup": "tab:olive",
        "prepare": "tab:purple",
        "tokenize": "tab:pink",
        "prefill": "tab:blue",
        "decode": "tab:orange",
    }
    rows = [p for p in PHASES if p in colors and any(e.phase == p for e in events)]
    for e in events:
        if e.phase in colors:
            ax.barh(
                rows.index(e.phase),
                max(e.duration, 1e-4),
                left=e.start,
                color=colors[e.phase],
                edgecolor="white",
                linewidth=0.3,
            )
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since start")
    return ax
