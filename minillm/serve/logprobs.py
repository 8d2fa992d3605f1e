"""Logprobs in OpenAI's shapes, from the sampler's own numbers and the tokens' own bytes.

Each step of a request that asks for logprobs is kept by the request as the sampler saw it
(``Request.logprobs``, from ``candidates.token_logprobs``): the id it chose, that id's probability and
the most likely ids, in the distribution ``sample`` draws from (after
temperature, top-k, top-p, min-p and the repetition penalty; at temperature 0, the distribution
at temperature 1). A token's ``bytes`` are its own (``Tokenizer.token_bytes``): joined, they give
the answer's UTF-8 even where one character is split over several tokens (emoji, CJK). Its
``token`` is that text when the bytes are whole characters, else the bytes that are not written
as ``\\xNN`` escapes (``b'\\xf0\\x9f'`` -> the 8 characters ``\\xf0\\x9f``), as OpenAI does.
"""

from __future__ import annotations

import math

# OpenAI's stand-in for "too unlikely to list".
UNKNOWN_LOGPROB = -9999.0


def token_text(raw: bytes) -> str:
    """OpenAI's ``token`` for a token's bytes: its text, with bytes that are part of a character
    written as ``\\xNN`` (always valid UTF-8)."""
    return raw.decode("utf-8", errors="backslashreplace")


def logprob(prob: float | None) -> float:
    """``log(prob)``; UNKNOWN_LOGPROB for a probability of 0 or None."""
    return math.log(prob) if prob else UNKNOWN_LOGPROB


def entry(tokenizer, token_id: int, prob: float | None) -> dict:
    """One ``{"token", "logprob", "bytes"}`` of OpenAI's shape for ``token_id``."""
    raw = tokenizer.token_bytes(token_id)
    return {"token": token_text(raw), "logprob": logprob(prob), "bytes": list(raw)}


def content(tokenizer, steps, ids, top: int) -> list[dict]:
    """OpenAI's ``logprobs.content``: one entry per id of ``ids`` (the output's ids, in order)
    with its ``top`` (0..5) alternatives, from ``steps``: per token ``(id, probability, [(id,
    probability), ...])``, the request's ``logprobs`` as probabilities (:func:`of_result` converts them).

    Raises:
        ValueError: a step records another id than ``ids`` holds at its place (a bug).
    """
    out = []
    for token_id, (chosen, prob, candidates) in zip(ids, steps, strict=False):
        if int(token_id) != chosen:
            raise ValueError(f"logprobs: the sampler chose id {chosen} where the output has {token_id}")
        item = entry(tokenizer, chosen, prob)
        item["top_logprobs"] = [entry(tokenizer, i, q) for i, q in candidates[:top]]
        out.append(item)
    return out


def of_result(tokenizer, result, top: int) -> list[dict]:
    """One entry per output token of a finished request (a stopping EOS left out) in OpenAI's shape,
    from the numbers the sampler drew with (``result.logprobs``, ``SamplingParams.top_logprobs``:
    after the bias, penalties, mask, temperature, top-k, top-p, min-p; at temperature 0, the
    distribution at temperature 1); ``top``: alternatives per token (0..20)."""
    from minillm.runtime.stopping import StopReason

    ids = result.ids[:-1] if result.stop_reason is StopReason.EOS else result.ids
    steps = [(s["id"], math.exp(s["logprob"]), [(i, math.exp(q)) for i, q in s["top"]]) for s in result.logprobs]
    return content(tokenizer, steps, ids, top)


def text_offsets(entries: list[dict], start: int = 0) -> list[int]:
    """The legacy ``text_offset``: where each token starts in the text, in characters from
    ``start``; a token that starts inside a character starts where that character does."""
    offsets, joined = [], b""
    for e in entries:
        offsets.append(start + len(joined.decode("utf-8", errors="ignore")))
        joined += bytes(e["bytes"])
    return offsets


def joined_bytes(entries: list[dict]) -> bytes:
    """Every entry's bytes, in order: the answer's UTF-8."""
    return b"".join(bytes(e["bytes"]) for e in entries)
