"""Limits that protect the server process from one request: body size, prompt size, header size.

    body over --max-request-bytes (default 4 MiB)   -> 413: FastAPI's max_body_size (Starlette's
                                                       RequestBodyLimitMiddleware), answered in app.py
    prompt that cannot fit the context              -> 400, from its byte length, before tokenizing
    headers over --max-header-bytes                 -> uvicorn's h11 answers 400 (configured in server.py)
    JSON nested deeper than Python's parser allows  -> FastAPI's body parser answers 400

The prompt check needs no tokenizer run: no token of the model spans more than ``max_token_bytes``
bytes of text, so a prompt of ``b`` bytes has at least ``ceil(b / max_token_bytes)`` tokens.
"""

from __future__ import annotations

import json
import math

from . import protocol as p

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


class DeclaredLengthLimit:
    """ASGI wrapper around the whole app: a ``Content-Length`` over ``max_bytes`` gets 413 in OpenAI's
    shape before any byte of the body is read. (Starlette's limiter, inside, answers that case in
    plain text; a chunked body without a length still meets it, and app.py words its 413.)"""

    def __init__(self, app, max_bytes: int, on_refused=None):
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    async def __call__(self, scope, receive, send):
        length = dict(scope.get("headers") or []).get(b"content-length", b"") if scope["type"] == "http" else b""
        if not (length.isdigit() and int(length) > self.max_bytes):
            return await self.app(scope, receive, send)
        if self.on_refused is not None:
            self.on_refused()
        message = (
            f"the request body is {int(length):,} bytes but this server accepts at most {self.max_bytes:,} bytes "
            "(minillm serve --max-request-bytes); send a shorter prompt"
        )
        error = p.ErrorInfo(message=message, type="invalid_request_error", code="request_too_large")
        data = json.dumps(p.ErrorResponse(error=error).model_dump()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any one vocabulary entry is written with (an upper bound on the text
    bytes one token stands for: byte-level pieces write a byte as one or two bytes, SentencePiece's
    '▁' stands for one byte in three)."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max(len(piece.encode("utf-8")) for piece in vocab)


def prompt_bytes(prompt) -> int:
    """UTF-8 bytes of a completion prompt, or of all the contents of chat messages (the template
    only adds to them)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass"))
    return sum(len(str(m.get("content", "")).encode("utf-8", "surrogatepass")) for m in prompt)


def prompt_too_long(prompt, context: int, token_bytes: int) -> str | None:
    """The 400's message if the prompt surely leaves no room for a new token, else None.

    ``context``: positions a request may use; ``token_bytes``: :func:`max_token_bytes`.
    """
    n_bytes = prompt_bytes(prompt)
    at_least = math.ceil(n_bytes / token_bytes)
    if at_least < context:
        return None
    return (
        f"the prompt is {n_bytes:,} bytes, so at least {at_least:,} tokens (no token of this model spans more "
        f"than {token_bytes} bytes), but the context holds {context:,} positions; shorten it to at most "
        f"{context - 1:,} tokens (it was not tokenized)"
    )
