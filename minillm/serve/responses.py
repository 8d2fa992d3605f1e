"""What the server answers: OpenAI's JSON and Server-Sent Events shapes, and errors in OpenAI's shape.

How a request ends, as OpenAI's ``finish_reason`` (minillm's own reason is in the choice's
``minillm_stop_reason``):

    eos, stop string, stop-token sequence     -> "stop"
    max new tokens, context full              -> "length"
    timed out (--request-timeout)             -> "length"  (partial text; minillm_stop_reason "timed out")
    cancelled (the client went away)          -> "abort"   (as vLLM; nobody is left to read it)
"""

from __future__ import annotations

import asyncio
import json

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import minillm
from minillm.errors import InvalidConstraintError

from . import logprobs as lp
from . import protocol as p
from .jobs import Job, Outcome, TextDelta
from .reliability import MiniLLMBug

FINISH_REASON = {
    minillm.StopReason.EOS: "stop",
    minillm.StopReason.STOP_STRING: "stop",
    minillm.StopReason.STOP_SEQUENCE: "stop",
    minillm.StopReason.MAX_NEW_TOKENS: "length",
    minillm.StopReason.CONTEXT_FULL: "length",
    minillm.StopReason.TIMEOUT: "length",
    minillm.StopReason.CANCELLED: "abort",
}


class APIError(Exception):
    """An error with its HTTP status, answered in OpenAI's shape ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = p.ErrorResponse(
            error=p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def constraint_error(exc: Exception) -> APIError:
    """A ``response_format`` the engine refuses -> 400 naming the field: the same answer whether the
    HTTP layer checked it (the model loaded) or the request's admission did (after a load on demand)."""
    return APIError(400, f"response_format.json_schema.schema: {exc}", param="response_format")


def runtime_error(exc: Exception) -> APIError:
    """A MiniLLMError the runtime raised (its message names the fix) -> 400; anything else -> 500."""
    if isinstance(exc, InvalidConstraintError):
        return constraint_error(exc)
    if isinstance(exc, minillm.MiniLLMError):
        return APIError(400, f"{type(exc).__name__}: {exc}", code=type(exc).__name__)
    if isinstance(exc, MiniLLMBug):
        return APIError(500, str(exc), "internal_error", code="minillm_bug")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 -> a 400 naming the first bad field, its value and the allowed range."""
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})")
    if err.get("type") == "unsupported_field":
        field = err["ctx"]["field"]
        return APIError(400, err["msg"], param=field, code="unsupported_field")
    if param == "n":
        return APIError(
            400,
            f"n={err.get('input')!r} is not supported: minillm runs one sequence per request; "
            "send n=1 (or several requests)",
            param="n",
        )
    got = f", got {err['input']!r}" if "input" in err and err["type"] != "missing" else ""
    return APIError(400, f"{param or 'body'}: {err['msg']}{got}", param=param, code=err.get("type"))


def usage(o: Outcome) -> p.UsageInfo:
    """The ``usage`` block: tokens in and out (cached prompt tokens among them), load seconds, speculation."""
    return p.UsageInfo(
        prompt_tokens=o.prompt_tokens,
        completion_tokens=o.completion_tokens,
        total_tokens=o.prompt_tokens + o.completion_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=o.cached_tokens),
        load_s=o.load_s,
        **(o.speculative or {}),
    )


def chat_logprobs(o: Outcome) -> p.ChoiceLogprobs | None:
    """The chat shape of the logprobs (one entry per token), or None when the request asked for none."""
    return chat_shape(o.logprobs)


def chat_shape(entries: list[dict] | None) -> p.ChoiceLogprobs | None:
    """``{"content": entries}``, or None for None (no logprobs asked)."""
    return None if entries is None else p.ChoiceLogprobs(content=entries)


def completion_logprobs(o: Outcome) -> p.CompletionLogprobs | None:
    """The legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
    return legacy_shape(o.logprobs)


def legacy_shape(entries: list[dict] | None, start: int = 0) -> p.CompletionLogprobs | None:
    """The legacy shape of ``entries`` (None for None); ``start``: the characters a stream already sent
    (the first entry's offset)."""
    if entries is None:
        return None
    return p.CompletionLogprobs(
        tokens=[e["token"] for e in entries],
        token_logprobs=[e["logprob"] for e in entries],
        top_logprobs=[{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        text_offset=lp.text_offsets(entries, start),
    )


def final_response(o: Outcome, request_id: str, served_model: str, chat: bool):
    """The whole answer of a request not streamed: a ``ChatCompletion`` (``chat``) or a ``Completion``."""
    finish, reason = FINISH_REASON[o.stop_reason], o.stop_reason.value
    if chat:
        choice = p.ChatCompletionChoice(
            message=p.ChatMessageOut(content=o.text),
            logprobs=chat_logprobs(o),
            finish_reason=finish,
            minillm_stop_reason=reason,
            minillm_error=o.incomplete,
        )
        return p.ChatCompletion(id=request_id, model=served_model, choices=[choice], usage=usage(o))
    choice = p.CompletionChoice(
        text=o.text, logprobs=completion_logprobs(o), finish_reason=finish, minillm_stop_reason=reason
    )
    return p.Completion(id=request_id, model=served_model, choices=[choice], usage=usage(o))


def sse_line(obj) -> str:
    """One Server-Sent Event, ``data: <json>`` and a blank line, for a pydantic model or a dict."""
    data = obj.model_dump_json(exclude_none=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


async def sse(job: Job, first, body, served_model: str, chat: bool, watcher: asyncio.Task):
    """Server-sent events in OpenAI's chunk shapes, ending with ``data: [DONE]``.

    Logprobs (if asked) come as OpenAI sends them: each chunk with its own tokens' (a ``TextDelta``'s);
    the chunk that carries finish_reason has those of tokens whose text never came (a stop string's,
    held back then cut) or came in no chunk yet. Usage comes in a last chunk with no
    choices when ``stream_options.include_usage`` is true.
    """
    rid, include_usage = job.request_id, bool(body.stream_options and body.stream_options.include_usage)
    usage_none = {"usage": None} if include_usage else {}

    sent = {"entries": 0, "chars": 0}  # the logprobs entries already streamed, and their characters

    def chunk(delta: str | None = None, role: str | None = None, outcome: Outcome | None = None):
        finish = FINISH_REASON[outcome.stop_reason] if outcome else None
        reason = outcome.stop_reason.value if outcome else None
        mine = delta.logprobs if isinstance(delta, TextDelta) else None  # this delta's tokens' entries
        if outcome is not None and outcome.logprobs is not None:
            mine = outcome.logprobs[sent["entries"] :] or None  # those that came with no text (if any)
        start = sent["chars"]
        sent["entries"] += len(mine or ())
        sent["chars"] += len(lp.joined_bytes(mine or ()).decode("utf-8", errors="ignore"))
        if chat:
            choice = p.ChatCompletionChunkChoice(
                delta=p.DeltaMessage(role=role, content=None if delta is None else str(delta)),
                logprobs=chat_shape(mine),
                finish_reason=finish,
                minillm_stop_reason=reason,
                minillm_error=outcome.incomplete if outcome else None,
            )
            return p.ChatCompletionChunk(id=rid, model=served_model, choices=[choice], **usage_none)
        choice = p.CompletionChoice(
            text=str(delta or ""),
            logprobs=legacy_shape(mine, start),
            finish_reason=finish,
            minillm_stop_reason=reason,
        )
        return p.Completion(id=rid, model=served_model, choices=[choice], **usage_none)

    try:
        if chat:
            yield sse_line(chunk("", role="assistant"))
        item = first
        while True:
            kind, value = item
            if kind == "delta":
                yield sse_line(chunk(value))
            elif kind == "error":  # after text was sent the status is already 200: say it in the stream
                err = runtime_error(value)
                yield sse_line({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})
                break
            else:
                yield sse_line(chunk(outcome=value))
                if include_usage:
                    cls = p.ChatCompletionChunk if chat else p.Completion
                    yield sse_line(cls(id=rid, model=served_model, choices=[], usage=usage(value)))
                break
            item = await job.channel.get()
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # the client went away mid-stream (or we are done: then it changes nothing)
        watcher.cancel()
