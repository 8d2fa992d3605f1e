"""What keeps one request's trouble its own: fault isolation, backpressure, the counters that say so.

    a bug while serving one request      -> that request ends with a 500 naming minillm's bug; its
    (sampler, stop chain, detokenizer)      blocks go back to the pool; the batch's other rows go on
    a client that reads too slowly       -> past ``--stream-buffer`` unsent chunks the request is
                                            cancelled with that reason; the step loop never waits
    a shutdown (``shutdown.py``)         -> running requests are cancelled with the reason given

The worker calls :class:`Guard` between steps and when a request ends; the guard holds no model
state, only limits, counters and the reason (if any) every running request must stop for. It
never reaches into the worker: it is handed requests and jobs, and returns what to answer.

Test hook (only with ``minillm serve --test-faults``): a request's extra field
``"minillm_test_fault": {"stage": "sampler" | "detokenizer" | "stop", "at_token": N}`` raises
:class:`InjectedFault` inside that request's own sampler, detokenizer or stop chain when it
makes its N-th token. ``{"stage": "admission", "hold_s": S}`` raises nothing: the worker holds
that request where it has left the queue, is prepared, and is not yet in the scheduler, until
another request reaches the server (queued or refused) or S seconds pass; the window in which
``--max-queue`` must still count it as waiting (``worker.py``). Without the flag the field is
refused with a 400.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

import minillm
from minillm.runtime.scheduler import BatchRequest

FAULT_STAGES = ("sampler", "detokenizer", "stop")  # the stages that raise; "admission" holds (worker.py)
_PACKAGE = Path(minillm.__file__).resolve().parent.parent


class InjectedFault(RuntimeError):
    """The exception ``--test-faults`` raises on purpose inside one request."""


class ReliabilityMetrics:
    """Counters for how requests ended badly or were turned away (the leak checks' gauges are
    :class:`~minillm.serve.metrics.ServerMetrics`', read at scrape time like the others)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.failed = Counter(
            "minillm_request_failed_by_bug", "Requests ended by an exception in minillm (500)", ["stage"], registry=r
        )
        self.shed = Counter(
            "minillm_request_shed_by_backpressure", "Streams cancelled: the client read too slowly", registry=r
        )
        self.refused = Counter(
            "minillm_request_refused_at_admission", "Requests refused before any model work", ["reason"], registry=r
        )
        self.drained = Counter(
            "minillm_request_drained", "Requests in flight when shutdown began, by how they ended", ["how"], registry=r
        )


class Guard:
    """Limits and counters the worker consults; the shutdown sets ``stop_reason`` to end the rest.

    Args:
        metrics: the server's :class:`~minillm.serve.metrics.ServerMetrics` (its registry gets ours).
        stream_buffer: text chunks a stream may have waiting unsent before it is cancelled (>= 1).
        test_faults: accept the ``minillm_test_fault`` request field (tests only).
    """

    def __init__(self, metrics, *, stream_buffer: int = 256, test_faults: bool = False):
        self.counters = ReliabilityMetrics(metrics.registry)
        self.stream_buffer, self.test_faults = stream_buffer, test_faults
        self.stop_reason: str | None = None  # set by the shutdown: every running request ends with it
        self.token_bytes: int | None = None  # the longest vocabulary entry, bytes (limits.py; set on first use)
        self.draining = False  # set by the shutdown: new requests get 503
        self.in_flight: dict[str, float] = {}  # request id -> arrival (perf_counter), until its end is sent
        self.drained: list[tuple[str, str, str]] = []  # (request id, finished|cancelled|failed, how) at shutdown

    def track(self, job) -> None:
        """A job was queued: it is in flight until the worker sends its end (on the event loop)."""
        self.in_flight[job.request_id] = job.arrival

    def ended(self, request_id: str, item) -> None:
        """The worker sent a request's end (``("done", Outcome)`` or ``("error", exc)``)."""
        if self.in_flight.pop(request_id, None) is None or not self.draining:
            return
        kind, value = item
        if kind == "error":
            how, label = f"error: {value}", "failed"
        elif value.stop_reason is minillm.StopReason.CANCELLED:
            why = f" ({self.stop_reason})" if self.stop_reason else ""
            how, label = f"cancelled{why} after {value.completion_tokens} tokens", "cancelled"
        else:
            how, label = f"{value.stop_reason.value}, {value.completion_tokens} tokens", "finished"
        self.counters.drained.labels(how=label).inc()
        self.drained.append((request_id, label, how))

    def between_steps(self, requests: Iterable[GuardedRequest]) -> None:
        """On the worker thread: cancel every one of the worker's ``requests`` with ``stop_reason`` once it is set."""
        if self.stop_reason is None:
            return
        for request in requests:
            request.cancel(self.stop_reason)

    def shed(self, a) -> bool:
        """True if this stream's client is too far behind: cancel it (once) and send it no more text.

        Reads the stream's channel length only; never waits on the client.
        """
        if a.shed:
            return True
        behind = a.job.channel.qsize()
        if behind <= self.stream_buffer or a.request.stop_reason is not None:
            return False
        a.shed = True
        a.request.cancel(
            f"the client read too slowly: {behind} chunks waited unsent (--stream-buffer {self.stream_buffer})"
        )
        self.counters.shed.inc()
        return True

    def failure(self, a) -> MiniLLMBug | None:
        """If an ended request (the worker's ``Active``) ended by a bug of its own, count it and return
        the error to answer it with (the HTTP layer's 500); else None."""
        if a.request.error is None:
            return None
        stage, exc = a.request.error
        self.counters.failed.labels(stage=stage).inc()
        return MiniLLMBug(stage, exc, a.job.request_id)

    def bug(self, job, stage: str, exc: Exception) -> MiniLLMBug:
        """A bug outside any one request's step (admission, answering): count it; returns the error
        to answer ``job`` with."""
        self.counters.failed.labels(stage=stage).inc()
        return MiniLLMBug(stage, exc, job.request_id)


class MiniLLMBug(Exception):
    """An exception minillm raised while serving one request; the HTTP layer answers 500."""

    def __init__(self, stage: str, exc: BaseException, request_id: str):
        self.stage, self.original = stage, exc
        super().__init__(
            f"internal error: a bug in minillm ended this request in its {stage}: {describe(exc)}. "
            "Only this request was ended (its KV-cache blocks were freed; other requests go on). "
            f"Please report it with the request body and GET /v1/traces/{request_id}."
        )


_STAGES = {"sampling.py": "sampler", "stopping.py": "stop chain", "detokenize.py": "detokenizer"}


def stage_of(exc: BaseException, default: str = "sampler, stop chain or detokenizer") -> str:
    """Which part of a request raised: the injected stage, else read from the innermost minillm frame."""
    if isinstance(exc, InjectedFault):
        return exc.stage
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if (stage := _STAGES.get(Path(frame.filename).name)) is not None:
            return stage
    return default


def describe(exc: BaseException) -> str:
    """``Type: message (at path/file.py:line in function)`` for the innermost frame of the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        f = frames[-1]
        path = Path(f.filename)
        try:
            path = path.resolve().relative_to(_PACKAGE)
        except ValueError:
            pass
        where = f" (at {path}:{f.lineno} in {f.name})"
    return f"{type(exc).__name__}: {exc}{where}"


class GuardedRequest(BatchRequest):
    """A :class:`BatchRequest` whose own exceptions end only itself.

    An exception while it samples, runs its stop chain or detokenizes (``take``) or releases held
    text (``flush``) is kept in ``error`` as ``(stage, exception)``; the request is then cancelled,
    so the scheduler finishes it at once (its blocks return to the pool) and the other rows of
    the step are untouched. ``fault``: ``{"stage": ..., "at_token": N}`` raises
    :class:`InjectedFault` on purpose (``--test-faults``; the admission stage is the worker's).
    """

    def __init__(self, *args, fault: dict | None = None, **options):
        super().__init__(*args, **options)
        self.error: tuple[str, BaseException] | None = None
        if fault is not None and fault["stage"] in FAULT_STAGES:
            _inject(self, fault["stage"], fault["at_token"])

    def take(self, logits, step_t0):
        if self.error is not None:
            return []
        try:
            return list(super().take(logits, step_t0))
        except Exception as exc:  # noqa: BLE001 - the request's own bug: end it, keep the batch
            return self._fail(stage_of(exc), exc)

    def flush(self):
        if self.error is not None:
            return []
        try:
            return list(super().flush())
        except Exception as exc:  # noqa: BLE001
            return self._fail(stage_of(exc, "detokenizer"), exc)

    def _fail(self, stage: str, exc: Exception) -> list:
        self.error = (stage, exc)
        self.stop_reason, self.condition = minillm.StopReason.CANCELLED, f"minillm bug in its {stage}"
        return []


def _inject(request: GuardedRequest, stage: str, at_token: int) -> None:
    """Make ``stage`` of this one request raise when it handles its ``at_token``-th new token."""

    def boom():
        exc = InjectedFault(f"injected by --test-faults in the {stage} at token {at_token}")
        exc.stage = "stop chain" if stage == "stop" else stage
        raise exc

    if stage == "sampler":
        params = request.params

        class FaultyParams:  # sampling reads the params first thing: fail there at the N-th token
            def __getattr__(self, name):
                if len(request.new_ids) + 1 == at_token:
                    boom()
                return getattr(params, name)

        request.params = FaultyParams()
    elif stage == "detokenizer":
        _wrap(request.output, "detokenizer", "add", lambda: len(request.new_ids) == at_token, boom)
    else:
        _wrap(request, "criteria", "check", lambda: len(request.new_ids) == at_token, boom)


def _wrap(owner, attr: str, method: str, due, boom) -> None:
    """Replace ``owner.attr`` by a proxy whose ``method`` calls ``boom()`` when ``due()``."""
    inner = getattr(owner, attr)

    class Faulty:
        def __getattr__(self, name):
            value = getattr(inner, name)
            if name != method:
                return value

            def call(*args, **kwargs):
                if due():
                    boom()
                return value(*args, **kwargs)

            return call

    setattr(owner, attr, Faulty())


def hold_admission(fault: dict, another_came: Callable[[], bool]) -> None:
    """``--test-faults``' admission stage: keep the job the worker is admitting (taken from the queue,
    not yet in the scheduler) until ``another_came()`` (another request reached ``submit``, queued or
    refused), at most ``fault["hold_s"]`` seconds: the window in which ``--max-queue`` must still count it."""
    deadline = time.monotonic() + fault.get("hold_s", 30.0)
    while not another_came() and time.monotonic() < deadline:
        time.sleep(0.005)


class Channel(asyncio.Queue):
    """A job's channel that tells the guard (and ``on_end``, if set: the key's quotas) when the
    request's last item (its end) is put in it."""

    def __init__(self, guard: Guard, request_id: str, on_end: Callable[[tuple], None] | None = None):
        super().__init__()
        self.guard, self.request_id, self.on_end = guard, request_id, on_end

    def put_nowait(self, item) -> None:
        super().put_nowait(item)
        if item[0] != "delta":
            self.guard.ended(self.request_id, item)
            if self.on_end is not None:
                self.on_end(item)
