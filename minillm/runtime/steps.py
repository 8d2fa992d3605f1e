"""The request lifecycle's phases, one small function each, with no tracing code in them.

    load -> tokenize -> prefill -> sample -> decode_step ... -> detokenize -> stop -> free

``load`` is in ``loading.py``; ``generate.py`` runs these phases in a loop and tells listeners
(the trace) what happened. Lifetimes follow llama2.c: a :class:`~minillm.runtime.loaded_model.Model`
(weights, tokenizer) lives across requests; a :class:`~minillm.model.kv_cache.KVCache` lives for
one request and is reset or freed at its end.
"""

from __future__ import annotations

import time

import numpy as np

from minillm.errors import InvalidRequestError
from minillm.model.kv_cache import KVCache
from minillm.runtime import sampling
from minillm.runtime.loaded_model import Model
from minillm.runtime.sampling import SamplingParams
from minillm.text.detokenize import detokenize as _detokenize

Prompt = str | list[dict]


def is_chat(prompt: Prompt, chat: bool | None) -> bool:
    """A message list always goes through the chat template; a ``str`` only with ``chat=True``."""
    return isinstance(prompt, list) if chat is None else chat


def prompt_text(model: Model, prompt: Prompt, *, chat: bool | None = None, **chat_options) -> str:
    """The text the model will read: the chat template rendered over the messages, or the prompt.

    ``chat_options`` go to the template (``Tokenizer.apply_chat_template``): ``tools``,
    ``documents``, ``continue_final_message``, ``add_generation_prompt``, ``enable_thinking`` ...

    Raises:
        InvalidRequestError: empty prompt, or chat options with a completion prompt.
        ChatTemplateError: bad messages or no template.
    """
    if not prompt:
        raise InvalidRequestError("the prompt is empty; give at least one character (or one message).")
    if not is_chat(prompt, chat):
        if chat_options:
            raise InvalidRequestError(
                f"chat options {sorted(chat_options)} only apply to chat prompts; pass messages or chat=True"
            )
        return prompt
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return model.tokenizer.apply_chat_template(messages, **chat_options)


def tokenize(model: Model, prompt: Prompt, *, chat: bool | None = None, **chat_options) -> np.ndarray:
    """Turn a prompt into token ids ``[seq]`` int64.

    A ``str`` is encoded as a completion prompt unless ``chat=True``; a list of
    ``{"role", "content"}`` messages always goes through the model's chat template (rendered in a
    jinja2 sandbox, then encoded without adding special tokens, so there is never a second BOS).
    ``chat_options`` (``tools=``, ``documents=``, ``continue_final_message=True``,
    ``enable_thinking=False`` ...) are passed to the template as transformers passes them; by
    default the assistant's turn is opened (``add_generation_prompt``) unless continuing a message.

    Raises:
        InvalidRequestError: empty prompt, or chat options with a completion prompt.
        ChatTemplateError: bad messages or options, no template, the template's own refusal.
    """
    chat = is_chat(prompt, chat)
    return model.tokenizer.encode(prompt_text(model, prompt, chat=chat, **chat_options), add_special_tokens=not chat)


def prepare(model: Model, prompt: Prompt, *, chat: bool | None = None) -> tuple[str, np.ndarray, float]:
    """:func:`prompt_text` and its ids at once: ``(text, ids [seq] int64, seconds both took)``, what a
    request takes as ``prepared=`` when its caller tokenized it already (the server's worker sizes a
    request by its ids, ``generate_batch`` its default pool), so no prompt is tokenized twice.

    Raises:
        InvalidRequestError, ChatTemplateError: as :func:`prompt_text`.
    """
    t0 = time.perf_counter()
    chat = is_chat(prompt, chat)
    text = prompt_text(model, prompt, chat=chat)
    return text, model.tokenizer.encode(text, add_special_tokens=not chat), time.perf_counter() - t0


def prefill(model: Model, ids: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run the whole prompt through the model in one forward pass; fill the KV cache.

    Args:
        ids: prompt ids ``[seq]``; written to cache positions ``cache.length..+seq``.

    Returns:
        float32 logits ``[vocab]`` for the token after the prompt.

    Raises:
        InvalidRequestError: no ids.
        KVCacheFullError (a ContextWindowExceeded): the prompt does not fit in the cache.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) == 0:
        raise InvalidRequestError("prefill got no tokens; tokenize a non-empty prompt first.")
    return model.transformer.forward(ids, cache, last_only=True)[0]  # [vocab]


def decode_step(model: Model, token_id: int, cache: KVCache) -> np.ndarray:
    """Feed one token at position ``cache.length``; the cache grows by one.

    Returns:
        float32 logits ``[vocab]`` for the next token.

    Raises:
        KVCacheFullError: no room in the cache for one more position.
    """
    return model.transformer.forward(np.array([token_id], dtype=np.int64), cache)[0]  # [vocab]


class RowLogits:
    """A verification's logits, scored row by row on demand: ``rows[i]`` is float32 ``[vocab]``, the
    LM head over row ``i`` of the residual stream ``hidden`` ``[k + 1, d_model]`` (computed once, then
    kept). The head is the model's largest product, and a row past the first rejected draft is never
    looked at; ``scored``: how many rows were."""

    def __init__(self, transformer, hidden: np.ndarray):
        self.transformer, self.hidden = transformer, hidden
        self.rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.hidden)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of a verification of {len(self)} rows")
        i %= len(self)
        if i not in self.rows:
            self.rows[i] = self.transformer.compute_logits(self.hidden[i : i + 1])[0]  # [vocab]: one matrix-vector row
        return self.rows[i]


def verify_step(model: Model, token_id: int, drafted, cache: KVCache) -> RowLogits:
    """Feed ``token_id`` and the ``k`` drafted ids at ``cache.length..``, one forward pass (a short
    prefill); the cache grows by ``k + 1`` (speculative decoding truncates the rejected ones).

    Returns:
        :class:`RowLogits`, ``k + 1`` rows of float32 logits ``[vocab]``: row ``i`` scores the token
        after the first ``i`` drafts, its LM head computed when it is first read.

    The ``k + 1`` rows go through the layers' batched products (``hidden_batch``: the kernels'
    few-rows forms); the head, one matrix-vector product per row read, costs only the rows the
    acceptance rule reaches.

    Raises:
        KVCacheFullError: no room for ``k + 1`` more positions.
    """
    ids = np.array([token_id, *drafted], dtype=np.int64)
    hidden = model.transformer.hidden_batch([(ids, cache)])  # [k + 1, d_model]: no head yet
    return RowLogits(model.transformer, hidden)


def sample(
    logits: np.ndarray,
    params: SamplingParams | None = None,
    rng: np.random.Generator | None = None,
    seen_ids=(),
    generated_ids=(),
    allowed: np.ndarray | None = None,
) -> int:
    """Choose the next token id from logits ``[vocab]`` (see ``sampling.py``). No ``params``:
    greedy, the argmax (``sampling.GREEDY``), as everywhere in minillm. Pass one ``rng`` for a
    whole request; ``seen_ids`` (prompt + new) for the repetition penalty, ``generated_ids`` (new
    only) for the frequency and presence penalties, ``allowed`` (``bool [vocab]``) for a mask."""
    return sampling.sample(logits, params or sampling.GREEDY, rng, seen_ids, generated_ids, allowed)


def detokenize(model: Model, ids, *, skip_special_tokens: bool = True) -> str:
    """Token ids -> text with the model's tokenizer (special tokens hidden by default)."""
    return _detokenize(model.tokenizer, ids, skip_special_tokens=skip_special_tokens)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading ids ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
