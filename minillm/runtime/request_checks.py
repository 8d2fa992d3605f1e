"""A request's arguments, checked before any model work: each bad value a clear error naming the fix.

``request.Request`` calls these first; the stop chain checks its own (``stopping.validate_stop_strings``,
``stopping.validate_stop_token_ids``), as the sampler does its parameters (``SamplingParams``).
"""

from __future__ import annotations

from minillm.errors import ContextWindowExceeded, InvalidRequestError
from minillm.model.config import KV_DTYPES
from minillm.model.kv_cache import KVCache


def check_arguments(max_new_tokens, timeout_s) -> None:
    """Check the request's token budget and its deadline.

    Raises:
        InvalidRequestError: ``max_new_tokens`` not a whole number >= 1, ``timeout_s`` not a number
            of seconds > 0.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens!r} (a whole number of tokens).")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise InvalidRequestError(f"timeout_s must be a number of seconds > 0 (or None), got {timeout_s!r}.")


def check_logit_bias(model, params) -> None:
    """Raises InvalidRequestError if ``params.logit_bias`` (sorted by id) names an id outside the vocabulary."""
    if params.logit_bias and params.logit_bias[-1][0] >= model.config.vocab_size:
        raise InvalidRequestError(
            f"logit_bias names token id {params.logit_bias[-1][0]}, outside the vocabulary "
            f"[0, {model.config.vocab_size}); use ids the model's tokenizer gives"
        )


def check_window(n_prompt: int, window: int, context: int, by_cache: bool) -> None:
    """The prompt must leave room for at least one new token: ``n_prompt < window``.

    Raises:
        ContextWindowExceeded: with both numbers and the fix; ``cli_message`` names ``--max-seq-len``
            where the message names the library's ``max_seq_len``.
    """
    if n_prompt < window:
        return

    def sentence(option: str) -> str:
        fix = f", or pass a larger {option} (the model holds {context:,})" if by_cache else ""
        return (
            f"prompt is {n_prompt:,} tokens but the {'KV cache' if by_cache else 'model'} holds {window:,} "
            f"positions, which leaves no room for a new token; shorten the prompt to at most {window - 1:,} "
            f"tokens{fix}."
        )

    raise ContextWindowExceeded(sentence("max_seq_len"), cli_message=sentence("--max-seq-len"))


def check_kv_dtype(kv_dtype: str | None, cache: KVCache | None) -> str:
    """The KV dtype a request uses: ``kv_dtype``, else the given cache's, else ``"float32"``.

    Raises:
        InvalidRequestError: a dtype not in ``KV_DTYPES`` (naming the choices), or one that is not
            the given cache's own.
    """
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise InvalidRequestError(
            f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r} (float16 halves the KV cache, "
            "int8 stores a quarter plus a float32 scale per position and head)."
        )
    have = getattr(cache, "dtype", None) if cache is not None else None
    if kv_dtype is not None and have is not None and kv_dtype != have:
        raise InvalidRequestError(
            f"kv_dtype={kv_dtype!r} but the cache passed holds {have}; pass kv_dtype={have!r} (or none), or a "
            f"cache made with KVCache.for_model(config, dtype={kv_dtype!r})."
        )
    return kv_dtype or have or "float32"
