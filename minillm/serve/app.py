"""The OpenAI-compatible HTTP server: a thin shell that hands each request to the model worker, whose
scheduler runs it in a continuous batch with the others (``worker.py``, ``runtime/scheduler.py``).

    POST /v1/chat/completions   messages -> chat template -> scheduler (SSE when "stream": true)
    POST /v1/completions        prompt -> scheduler, no template
    GET  /v1/models             the models this server holds (one, or several: ``models.py``)
    GET  /v1/models/{id}        one of them (OpenAI's retrieve); 404 model_not_found for another name
    GET  /v1/traces/{id}        a finished request's trace events (the newest --keep-traces)
    GET  /v1/events             Server-Sent Events: requests, steps, the KV pool, live (``events.py``)
    GET  /ui                    the live page those events feed (``static/ui.html``)
    GET  /health                503 while loading and warming up (calibration included), 200 when ready
    GET  /metrics               Prometheus text: TTFT, TPOT, e2e, queue wait, tokens, KV bytes, use per key

With API keys (``auth.py``) every route but /health needs one; an observer key only watches; what a
caller sees of other keys' requests is ``privacy.py``'s; each key's quotas are ``quotas.py``'s.

The model runs on one worker thread (``worker.py``); this module only moves bytes on the event loop.
It talks to one interface, :class:`~minillm.serve.interface.ServedModels`: one model's ``Worker``
or several models' ``ModelRegistry`` (``models.py``), never asking which.

The answers' shapes (JSON and Server-Sent Events) and errors are built in ``responses.py``.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import minillm
from minillm.observe import calibrate
from minillm.runtime.constraint import Constraint, grammar_for

from . import protocol as p
from .auth import OPEN, Access, KeyCheck
from .events import EventStreamResponse, TooManySubscribers
from .interface import ServedModels
from .jobs import Job, QueueFullError, watch_disconnect
from .limits import DEFAULT_MAX_REQUEST_BYTES, max_token_bytes, prompt_too_long
from .privacy import trace_for, viewer_for
from .quotas import Quotas
from .reliability import Channel
from .responses import APIError, constraint_error, final_response, runtime_error, sse, validation_error

__all__ = ["APIError", "create_app"]
RETRY_AFTER_S = 1  # what a 429 tells the client to wait, seconds
UI_PAGE = Path(__file__).parent / "static" / "ui.html"  # GET /ui (module-level: a test may point it elsewhere)


def create_app(
    served: ServedModels, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, access: Access | None = None
) -> FastAPI:
    """The FastAPI app in front of ``served`` (one model's ``Worker`` or a ``ModelRegistry``): its
    gauges are bound here, once; clients name its models by ``served.served_names()``. A body over
    ``max_request_bytes`` is refused with 413 (``limits.py``). ``access``: keys, what observers see,
    CORS origins and quotas (``auth.py``; default: no keys, no CORS, no quotas)."""
    access = access or Access()
    served.metrics.bind(served)  # /metrics' gauges read the interface at scrape time

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.start()  # loads in the background: the socket listens now, /health says 503 until ready
        yield

    app = FastAPI(
        title="minillm",
        version=minillm.__version__,
        lifespan=lifespan,
        description="An OpenAI-compatible server for minillm (one worker thread, requests in arrival order).",
        max_body_size=max_request_bytes,  # Starlette's RequestBodyLimitMiddleware: 413 past it
    )
    _add_error_handlers(app, served.guard.counters.refused, max_request_bytes)
    _add_status_routes(app, served, access)
    _add_model_routes(app, served)
    _add_completion_routes(app, served, Quotas(served.metrics.registry, access.limits))
    app.add_middleware(KeyCheck, keys=access.keys, login_page=_page)  # who calls: 401 / 403 before any route
    if access.allowed_origins:  # outside the key check: a preflight carries no key, a 401 gets CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(access.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "last-event-id"],
            expose_headers=["x-request-id", "retry-after"],
        )
    return app


def _page() -> bytes | None:
    """The live page's HTML (None when its file is missing)."""
    return UI_PAGE.read_bytes() if UI_PAGE.is_file() else None


def _caller(request: Request):
    """Who sent ``request`` (``auth.KeyCheck`` put it in the request's state)."""
    return request.scope.get("state", {}).get("caller", OPEN)


def _add_error_handlers(app: FastAPI, refused, max_request_bytes: int) -> None:
    """Every error in OpenAI's shape: FastAPI's 422 as 400, Starlette's 413 and 404, a bug as 500."""

    # --- errors: always OpenAI's shape, never FastAPI's 422 ------------------------------------
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 413:
            refused.labels(reason="body_too_large").inc()
            return APIError(
                413,
                f"the request body is over {max_request_bytes:,} bytes, the most this server accepts "
                "(minillm serve --max-request-bytes); send a shorter prompt",
                code="request_too_large",
            ).response()
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_).response()

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):  # a bug in minillm: still OpenAI's shape
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error").response()


def _add_status_routes(app: FastAPI, worker: ServedModels, access: Access) -> None:
    """/health, /metrics, /v1/traces/{id}, /v1/events and /ui; traces and events as the
    caller may see them (``privacy.py``)."""

    def viewer(request: Request):
        caller = _caller(request)
        return viewer_for(caller.scope, caller.label, access.show_prompts)

    @app.get("/health")
    async def health():
        model = worker.served_names()[0]
        if worker.guard.draining:
            body = {"status": "draining", "model": model, "in_flight": len(worker.guard.in_flight)}
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        body = {"status": worker.status, "model": model}
        # how often this process measured the diagnosis's rates (machine, products rate): during the
        # warm-up, before this answers 200; a request's step never pays one (calibrate.MEASUREMENTS)
        body["calibration"] = {"measurements": calibrate.measurement_counts()}
        if worker.status == "loading" and worker.startup_delay_s > 0:
            body["note"] = f"startup delayed on purpose by --startup-delay {worker.startup_delay_s:g} s"
        if worker.error:
            body["error"] = worker.error
        return JSONResponse(body, status_code=200 if worker.status == "ready" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(worker.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/traces/{request_id}", responses={404: {"model": p.ErrorResponse}})
    async def trace(request_id: str, request: Request):
        record = trace_for(worker.trace(request_id), viewer(request))  # another key's: as if unknown
        if record is None:
            raise APIError(
                404,
                f"no trace for request {request_id!r}: unknown, still running, or older than the "
                f"last {worker.keep_traces} requests",
                "not_found_error",
                "request_id",
            )
        return record

    @app.get("/v1/events", responses={503: {"model": p.ErrorResponse}})
    async def events(request: Request):
        """Server-Sent Events (one JSON object per ``data:`` line, ``id:`` increasing); send
        ``Last-Event-ID`` to resume. The README lists the event types."""
        peer = f"{request.client.host}:{request.client.port}" if request.client else "?"
        try:
            sub, opening = worker.events.subscribe(request.headers.get("last-event-id"), peer, viewer(request))
        except TooManySubscribers as exc:
            raise APIError(
                503, f"{exc}; close another page first", "service_unavailable", code="too_many_subscribers"
            ) from None
        return EventStreamResponse(worker.events, sub, opening)

    @app.get("/ui", include_in_schema=False)
    async def ui():
        page = UI_PAGE
        if not page.is_file():
            raise APIError(
                404,
                f"GET /ui: the page's file {page} is missing from this installation (minillm/serve/static/ "
                "ships in the wheel); reinstall minillm, or read the events at GET /v1/events",
                "not_found_error",
                code="ui_not_installed",
            )
        return Response(page.read_bytes(), media_type="text/html; charset=utf-8")


def _add_model_routes(app: FastAPI, worker: ServedModels) -> None:
    """GET /v1/models and GET /v1/models/{id}: OpenAI's model objects, from ``worker.model_cards()``."""

    @app.get("/v1/models", response_model=p.ModelList)
    async def models():
        # several models (models.py) add each one's state, weight dtype and resident bytes
        return p.ModelList(data=[p.ModelCard(**card) for card in worker.model_cards()])

    @app.get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses={404: {"model": p.ErrorResponse}})
    async def model(model_id: str):
        """OpenAI's ``GET /v1/models/{model}`` (the client's ``models.retrieve``): that model's entry of
        GET /v1/models; 404 ``model_not_found`` for a name this server does not serve."""
        card = next((c for c in worker.model_cards() if c["id"] == model_id), None)
        if card is None:
            served = ", ".join(map(repr, worker.served_names()))
            message = f"model {model_id!r} not found; this server serves {served} (GET /v1/models)"
            raise APIError(404, message, "not_found_error", "model", "model_not_found")
        return p.ModelCard(**card)


def _add_completion_routes(app: FastAPI, worker: ServedModels, quotas: Quotas) -> None:
    """POST /v1/chat/completions and /v1/completions: a job for the worker, answered as JSON or SSE;
    the caller's key past a quota gets 429 (``quotas.py``)."""
    refused = worker.guard.counters.refused

    @app.post("/v1/chat/completions", response_model=p.ChatCompletion, responses=_ERRORS)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _handle(request, body, messages, True, max_tokens, top, worker.next_id("chatcmpl"))

    @app.post("/v1/completions", response_model=p.Completion, responses=_ERRORS)
    async def completions(body: p.CompletionRequest, request: Request):
        return await _handle(request, body, body.prompt, False, body.max_tokens, body.logprobs, worker.next_id("cmpl"))

    async def _handle(request, body, prompt, chat, max_tokens, top_logprobs, request_id):
        job = _make_job(worker, body, prompt, chat, max_tokens, top_logprobs, request_id)
        job.owner = key = _caller(request).label
        quotas.check(key)  # 429 past one of the key's quotas
        job.channel.on_end = lambda item: quotas.ended(key, item)
        try:
            worker.submit(job)
        except QueueFullError as exc:
            refused.labels(reason="queue_full").inc()
            raise APIError(
                429,
                f"server busy: {exc}; retry after {RETRY_AFTER_S} s",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        quotas.started(key)
        worker.guard.track(job)  # in flight until its end is sent (a shutdown waits for it)
        # The client leaving (at any time) sets the job's cancel flag; the worker checks it per step.
        watcher = asyncio.create_task(watch_disconnect(request, job))
        headers = {"x-request-id": request_id}
        try:
            first = await job.channel.get()  # a delta, or the end, or an error before any text
        except BaseException:
            job.cancel.set()
            watcher.cancel()
            raise
        if first[0] == "error":
            watcher.cancel()
            raise runtime_error(first[1])
        if body.stream:
            return StreamingResponse(
                sse(job, first, body, body.model, chat, watcher), headers=headers, media_type="text/event-stream"
            )
        try:
            item = first
            while item[0] == "delta":
                item = await job.channel.get()
        finally:
            watcher.cancel()
        if item[0] == "error":
            raise runtime_error(item[1])
        response = final_response(item[1], request_id, body.model, chat)
        return JSONResponse(response.model_dump(), headers=headers)


_ERRORS = {code: {"model": p.ErrorResponse} for code in (400, 404, 429, 503)}


def _make_job(worker: ServedModels, body, prompt, chat, max_tokens, top_logprobs, request_id) -> Job:
    """Check what only the server knows (model, readiness, context), then build the worker's job.

    Raises:
        APIError: 404 unknown model, 503 not ready, 400 max_tokens over the context or bad sampling values.
    """
    target = worker.target(body.model)  # the model the request names
    if target is None:
        served = ", ".join(map(repr, worker.served_names()))
        raise APIError(
            404,
            f"model {body.model!r} not found; this server serves {served} (GET /v1/models)",
            "not_found_error",
            "model",
            "model_not_found",
        )
    guard = worker.guard
    if guard.draining:
        guard.counters.refused.labels(reason="draining").inc()
        raise APIError(
            503,
            f"the server is shutting down (draining the requests in flight); retry after {RETRY_AFTER_S} s "
            "against a server that is up",
            "service_unavailable",
            code="draining",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if worker.status != "ready":
        raise APIError(503, f"the model is {worker.status}; wait for GET /health to answer 200", "service_unavailable")
    if body.minillm_test_fault is not None and not guard.test_faults:
        raise APIError(
            400,
            "minillm_test_fault is a test hook: start the server with --test-faults to use it",
            param="minillm_test_fault",
        )
    context = target.context
    if target.model is not None:  # loaded: a prompt too long in bytes is refused before tokenizing
        tokenizer = target.model.tokenizer
        if guard.token_bytes is None or guard.token_bytes[0] is not tokenizer:
            guard.token_bytes = (tokenizer, max_token_bytes(tokenizer))
        if (message := prompt_too_long(prompt, context, guard.token_bytes[1])) is not None:
            guard.counters.refused.labels(reason="prompt_too_long").inc()
            raise APIError(400, message, param="messages" if chat else "prompt", code="context_length_exceeded")
    if max_tokens is not None and max_tokens > context:
        raise APIError(
            400,
            f"max_tokens is {max_tokens:,} but the context holds {context:,} positions "
            f"(prompt included); ask for at most {context - 1:,}",
            param="max_tokens",
        )
    try:
        params = replace(minillm.SamplingParams.from_fields(body), top_logprobs=top_logprobs)
        speculative = _speculative(worker, body)
    except minillm.MiniLLMError as exc:
        raise runtime_error(exc) from None
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return Job(
        request_id=request_id,
        prompt=prompt,
        chat=chat,
        params=params,
        max_tokens=max_tokens,
        stop=stop or None,
        top_logprobs=params.top_logprobs,
        loop=asyncio.get_running_loop(),
        channel=Channel(guard, request_id),
        slow_motion_s=body.slow_motion_s,
        fault=body.minillm_test_fault.model_dump() if body.minillm_test_fault is not None else None,
        model=body.model,
        constraint=_constraint(target.model, body.response_format if chat else None),
        speculative=speculative,
    )


def _constraint(model: minillm.Model | None, response_format):
    """OpenAI's ``response_format`` -> a ``Constraint`` (None for text), checked against ``model``'s
    vocabulary when it is loaded (else the request's admission checks it, after the load).

    Raises:
        APIError: 400 json_schema without its schema, or a schema that is invalid (naming where).
    """
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        constraint = Constraint.json_object()
    elif response_format.json_schema is None:
        raise APIError(
            400,
            'response_format of type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}',
            param="response_format.json_schema",
        )
    else:
        constraint = Constraint.json_schema(response_format.json_schema.schema_)
    try:
        if model is not None:
            grammar_for(model, constraint)  # checked here, so the error names the field
    except minillm.MiniLLMError as exc:
        raise constraint_error(exc) from None
    return constraint


def _speculative(worker: ServedModels, body) -> minillm.Speculative | None:
    """The body's ``speculative`` / ``num_speculative_tokens`` over the server's default (``off``: none)."""
    default = worker.speculative
    draft = body.speculative or (default.draft if default else None)
    if draft in (None, "off"):
        return None
    k = body.num_speculative_tokens or (default.num_tokens if default else 4)
    return minillm.Speculative(draft=draft, num_tokens=k)
