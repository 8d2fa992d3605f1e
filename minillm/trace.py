"""The trace: one event per lifecycle phase, as plain data.

Events are dataclasses ``(phase, start, duration, data)`` collected by a :class:`Tracer`. The rich
renderer (``render.py``, terminal and Jupyter) is one consumer; ``Tracer.events``, the JSON lines
of :meth:`Tracer.to_jsonl` and :func:`plot_timeline` are others. Lifecycle functions take
``tracer=None`` and then do no tracing work at all.

Phases, in the order a request meets them::

    load -> warmup -> prepare -> tokenize -> prefill -> decode (one per step) -> stop -> summary
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

VERBOSITY = ("quiet", "summary", "steps", "full")
PHASES = ("load", "warmup", "prepare", "tokenize", "prefill", "decode", "stop", "summary")


@dataclass
class TraceEvent:
    """One phase: ``start`` is seconds since the tracer was made, ``duration`` seconds."""

    phase: str
    start: float
    duration: float
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """One JSON line; NumPy values and enums become plain JSON values."""
        return json.dumps(asdict(self), default=_jsonable)

    @classmethod
    def from_json(cls, line: str) -> "TraceEvent":
        return cls(**json.loads(line))


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
            (every phase; decode steps 1-5, every ``fold_every``-th, and the last), ``full``
            (every phase and every step).
        fold_every: see ``steps``.
        live: show the streamed text in a rich Live view at the bottom of a terminal (default:
            only when the console is a terminal; piped output gets the text at the stop event).
    """

    def __init__(self, console=None, verbosity: str = "steps", fold_every: int = 10,
                 live: bool | None = None):
        if verbosity not in VERBOSITY:
            raise ValueError(f"verbosity must be one of {VERBOSITY}, got {verbosity!r}")
        self.console = console
        self.verbosity = verbosity
        self.fold_every = fold_every
        self.t0 = time.perf_counter()
        self.events: list[TraceEvent] = []
        self._renderer = None
        if console is not None and verbosity != "quiet":
            from .render import Renderer

            self._renderer = Renderer(console, self, live=console.is_terminal if live is None else live)

    def now(self) -> float:
        """Seconds since this tracer was made."""
        return time.perf_counter() - self.t0

    def emit(self, phase: str, start: float, duration: float, **data: Any) -> TraceEvent:
        """Record an event (``start`` in :meth:`now` seconds, ``duration`` seconds) and render it."""
        event = TraceEvent(phase, start, duration, data)
        self.events.append(event)
        if self._renderer is not None:
            self._renderer.render(event)
        return event

    def stream_text(self, delta: str) -> None:
        """Show a text delta as it arrives (rendering only: the decode events carry it as data)."""
        if self._renderer is not None:
            self._renderer.stream_text(delta)

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
    colors = {"load": "tab:gray", "warmup": "tab:olive", "prepare": "tab:purple", "tokenize": "tab:pink",
              "prefill": "tab:blue", "decode": "tab:orange"}
    rows = [p for p in PHASES if p in colors and any(e.phase == p for e in events)]
    for e in events:
        if e.phase in colors:
            ax.barh(rows.index(e.phase), max(e.duration, 1e-4), left=e.start, color=colors[e.phase],
                    edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since start")
    return ax
