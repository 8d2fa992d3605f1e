"""The one interface the HTTP layer talks to: what a server's models offer, one model or several.

    app.py, responses.py, events.py  --- ServedModels --->  Worker         (worker.py: one model)
    (the event loop)                                         ModelRegistry  (models.py: several)

The HTTP layer never asks which of the two it holds: both answer the same questions (is it
ready, which names does it serve, what a named model's context is), take the same jobs
(:meth:`ServedModels.submit`) and feed the same gauges (read at scrape time, bound once by
``app.create_app``). ``tests/serve/test_interface.py`` checks that both classes have every member
below with a compatible signature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import minillm

    from .events import EventBus
    from .jobs import Job
    from .metrics import ServerMetrics
    from .reliability import Guard


class ServedModel(Protocol):
    """One served model as the HTTP layer checks a request against it (``ServedModels.target``)."""

    @property
    def context(self) -> int:
        """Positions a request may use (prompt and new tokens)."""

    @property
    def model(self) -> minillm.Model | None:
        """The loaded model (its tokenizer checks prompts and schemas); None while not loaded."""


class ServedModels(Protocol):
    """What a server's models offer the HTTP layer: state, names, jobs, traces and gauges.

    Attributes:
        status: ``starting``, ``loading``, ``ready`` or ``failed`` (GET /health: 200 only when ready).
        error: why loading failed (``Type: message``), else None.
        startup_delay_s: the deliberate wait before loading, seconds (``--startup-delay``).
        keep_traces: how many finished requests' traces :meth:`trace` keeps.
        metrics: the server's Prometheus metrics.
        guard: backpressure, fault isolation and the drain (``reliability.py``).
        events: the bus GET /v1/events reads (``events.py``).
        speculative: the draft a request that names none gets, or None.
    """

    status: str
    error: str | None
    startup_delay_s: float
    keep_traces: int
    metrics: ServerMetrics
    guard: Guard
    events: EventBus
    speculative: minillm.Speculative | None

    def start(self) -> None:
        """Start the thread that loads and serves (returns at once; :attr:`status` says when ready)."""

    def submit(self, job: Job) -> None:
        """Queue ``job`` for the model it names. Raises QueueFullError past ``--max-queue``."""

    def trace(self, request_id: str) -> dict | None:
        """A finished request's kept trace, or None (unknown, running, or dropped)."""

    def next_id(self, prefix: str) -> str:
        """A request id unique in this process, e.g. ``chatcmpl-1a2b3c4d-0007``."""

    def served_names(self) -> list[str]:
        """The names clients pass as ``model``; the first is the default (GET /health names it)."""

    def target(self, name: str) -> ServedModel | None:
        """The served model ``name`` names, or None: this server does not serve it."""

    def model_cards(self) -> list[dict]:
        """GET /v1/models' entries (``protocol.ModelCard`` fields), one per served name."""

    # --- the gauges /metrics reads at scrape time (counts, bytes): read-only properties ----------------
    running = property(doc="Requests in the running batch.")
    waiting = property(doc="Requests queued, being admitted, or in a scheduler but not running.")
    kv_bytes_reserved = property(doc="Bytes of KV-pool blocks held by requests (a shared block counted once).")
    kv_bytes_in_use = property(doc="Bytes holding the running requests' filled positions.")
    blocks_used = property(doc="KV-pool blocks held by requests.")
    blocks_total = property(doc="KV-pool blocks in all (0 while no model is loaded).")
    tracked = property(doc="Requests the worker holds state for (admitted and not yet answered).")
    alive = property(doc="True while the serving thread runs.")
