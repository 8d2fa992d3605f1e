"""Logprobs in OpenAI's shapes, from the model's own numbers and the tokens' own bytes.

Each step of a request that asks for logprobs is kept by the request (``Request.logprobs``, from
``candidates.model_logprobs``): the id the sampler chose, its log-probability and the most likely ids,
all in the model's own distribution, ``log_softmax`` of the raw logits -- before the bias, penalties,
temperature, top-k, top-p and min-p, as OpenAI and vLLM report them (what the sampler drew from is the
trace's, and the record's ``sampled_logprob``). A stream sends each token's entry with the text it
released (:func:`of_delta`). A token's ``bytes`` are its own (``Tokenizer.token_bytes``): joined, they give
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
    """One ``{"token", "logprob", "bytes"}`` of OpenAI's shape for ``token_id`` at probability ``prob``."""
    return entry_at(tokenizer, token_id, logprob(prob))


def entry_at(tokenizer, token_id: int, value: float) -> dict:
    """One ``{"token", "logprob", "bytes"}`` of OpenAI's shape for ``token_id`` at log-probability ``value``."""
    raw = tokenizer.token_bytes(token_id)
    return {"token": token_text(raw), "logprob": value, "bytes": list(raw)}


def content(tokenizer, steps, ids, top: int) -> list[dict]:
    """OpenAI's ``logprobs.content`` (:func:`of_steps`) from ``steps`` given as probabilities: per token
    ``(id, probability, [(id, probability), ...])``.

    Raises:
        ValueError: a step records another id than ``ids`` holds at its place (a bug).
    """
    as_logs = [{"id": c, "logprob": logprob(q), "top": [(i, logprob(r)) for i, r in alts]} for c, q, alts in steps]
    return of_steps(tokenizer, as_logs, ids, top)


def of_steps(tokenizer, steps: list[dict], ids, top: int) -> list[dict]:
    """OpenAI's ``logprobs.content``: one entry per id of ``ids`` (the output's ids, in order) with its
    ``top`` (0..20) alternatives, from ``steps``, the request's own records (``Request.logprobs``:
    ``{"id", "logprob", "top": [(id, logprob), ...]}``, natural log).

    Raises:
        ValueError: a step records another id than ``ids`` holds at its place (a bug).
    """
    out = []
    for token_id, step in zip(ids, steps, strict=False):
        if int(token_id) != step["id"]:
            raise ValueError(f"logprobs: the sampler chose id {step['id']} where the output has {token_id}")
        item = entry_at(tokenizer, step["id"], step["logprob"])
        item["top_logprobs"] = [entry_at(tokenizer, i, q) for i, q in step["top"][:top]]
        out.append(item)
    return out


def shown(ids, stop_reason) -> int:
    """How many of a request's new ``ids`` its answer shows: all but a stopping EOS."""
    from minillm.runtime.stopping import StopReason

    return len(ids) - (stop_reason is StopReason.EOS)


def of_result(tokenizer, result, top: int) -> list[dict]:
    """One entry per output token of a finished request (a stopping EOS left out) in OpenAI's shape, from
    ``result.logprobs`` (``SamplingParams.top_logprobs``): the model's own log-probabilities, before any
    processor (``candidates.model_logprobs``); ``top``: alternatives per token (0..20)."""
    return of_steps(tokenizer, result.logprobs, result.ids[: shown(result.ids, result.stop_reason)], top)


def of_delta(tokenizer, request, start: int, upto: int, top: int) -> list[dict]:
    """The entries a stream's delta carries: the running ``request``'s new ids ``start:upto`` (those whose
    text the delta released since the last one that carried logprobs), a stopping EOS left out."""
    upto = min(upto, shown(request.new_ids, request.stop_reason))
    return of_steps(tokenizer, request.logprobs[start:upto], request.new_ids[start:upto], top)


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
