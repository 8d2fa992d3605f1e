"""Constrained decoding: output that follows a JSON schema, a regular expression or a grammar.

A grammar speaks of characters, the model of tokens, and they do not line up: ``{"`` may be one
token, ``"na`` another. The grammar engine (llguidance, the optional ``constrained`` extra) walks
the vocabulary's byte strings against the grammar's state and answers, at each step, which ids
may come next. minillm does the rest:

    mask step     allowed ids -> ``bool [vocab]``; sampling sets the others to -inf after the
                  penalties and before temperature (``sampling.py``'s step 3), so top-k / top-p
                  choose among allowed ids and softmax renormalises over them
    forced run    when the grammar allows only one way on (``{"name": `` after ``{"``), those
                  tokens are appended without sampling and fed in one forward pass, like a
                  prefill chunk (``request.py``)
    end           once the grammar is complete only EOS is allowed; a budget that runs out first
                  leaves an incomplete document, which the result says (``incomplete``)

Every request carries its own :class:`ConstraintState` (in a batch too); the engine's tokenizer
view is built once per tokenizer and shared.
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import dataclass

import numpy as np

from minillm.errors import InvalidConstraintError, InvalidRequestError, install_command

KINDS = ("json_schema", "json_object", "regex", "lark")
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # minillm Tokenizer -> llguidance's view


@dataclass(frozen=True)
class Constraint:
    """What the output must match. Build one with :meth:`json_schema`, :meth:`json_object`,
    :meth:`regex` or :meth:`lark`; ``constraint=`` also takes a plain dict as a JSON schema."""

    kind: str
    source: str  # the schema as JSON text, the pattern, or the grammar

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        """Any JSON document valid against ``schema`` (a dict or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json_object", '{"type": "object"}')

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Text the whole of which matches ``pattern`` (Rust regex syntax, as llguidance)."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """Text in a Lark-style grammar (``start: ...``; llguidance's dialect, with ``%json``)."""
        return cls("lark", grammar)


def as_constraint(value) -> Constraint | None:
    """None, a :class:`Constraint`, or a dict (a JSON schema) -> a Constraint or None.

    Raises:
        InvalidRequestError: any other type.
    """
    if value is None or isinstance(value, Constraint):
        return value
    if isinstance(value, dict):
        return Constraint.json_schema(value)
    raise InvalidRequestError(
        f"constraint must be a dict (a JSON schema) or a minillm.Constraint, got {type(value).__name__}; e.g. "
        "Constraint.regex(r'[0-9]+') or Constraint.lark('start: \"yes\" | \"no\"')"
    )


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InvalidRequestError(
            f"constrained decoding needs the grammar engine llguidance, which the constrained extra installs: "
            f"{install_command('constrained')}"
        ) from None
    return llguidance


def require_engine(flag: str) -> None:
    """Check that the grammar engine is installed, before a model is loaded or fetched for ``flag``.

    Raises:
        InvalidRequestError: llguidance is not installed; the message names ``flag`` and the extra's install command.
    """
    try:
        _llguidance()
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{flag}: {exc}") from None


def _engine_tokenizer(model):
    """llguidance's view of the model's vocabulary (built once per tokenizer: it walks every token)."""
    tok = model.tokenizer
    if tok not in _ENGINES:
        ll = _llguidance()
        eos = sorted(tok.eos_token_ids)
        _ENGINES[tok] = ll.LLTokenizer(tok.backend.to_str(), n_vocab=model.config.vocab_size, eos_token=eos)
    return _ENGINES[tok]


def _schema_problem(text: str) -> str | None:
    """Where a JSON schema breaks the JSON Schema spec, by path (if ``jsonschema`` is installed)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"the schema is not valid JSON ({exc})"
    if not isinstance(schema, dict):
        return f"a JSON schema is an object, got {type(schema).__name__}"
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"at {exc.json_path}: {exc.message}"
    return None


def grammar_for(model, constraint: Constraint) -> str:
    """The engine's grammar for ``constraint``, checked against the model's vocabulary.

    Raises:
        InvalidConstraintError: an invalid schema (naming where), pattern or grammar (naming the
            line and column).
        InvalidRequestError: llguidance not installed, or an unknown constraint kind.
    """
    ll = _llguidance()
    what = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regex", "lark": "grammar"}
    if constraint.kind in ("json_schema", "json_object"):
        if problem := _schema_problem(constraint.source):
            raise InvalidConstraintError(f"invalid JSON schema: {problem}")
        grammar = ll.LLMatcher.grammar_from_json_schema(constraint.source)
    elif constraint.kind == "regex":
        grammar = ll.LLMatcher.grammar_from_regex(constraint.source)
    elif constraint.kind == "lark":
        grammar = ll.LLMatcher.grammar_from_lark(constraint.source)
    else:
        raise InvalidRequestError(f"unknown constraint kind {constraint.kind!r}; one of {', '.join(KINDS)}")
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, _engine_tokenizer(model))
    if is_error:
        raise InvalidConstraintError(f"invalid {what[constraint.kind]}: {messages[0].strip()}")
    return grammar


class ConstraintState:
    """One request's position in its grammar: the mask for the next token, the forced runs.

    Args:
        model: the loaded model (its tokenizer and vocabulary size).
        constraint: a :class:`Constraint` (or a dict: a JSON schema).

    Raises:
        InvalidRequestError: as :func:`grammar_for`.
    """

    def __init__(self, model, constraint):
        self.constraint = as_constraint(constraint)
        self.vocab = model.config.vocab_size
        self.eos = frozenset(model.tokenizer.eos_token_ids)
        self.engine, self.grammar = _engine_tokenizer(model), grammar_for(model, self.constraint)
        self.matcher = _llguidance().LLMatcher(self.engine, self.grammar)
        self.mask_s = 0.0  # the last mask's time, seconds

    def allowed(self) -> np.ndarray:
        """``bool [vocab]``: True for the ids the grammar allows next (EOS once it is complete)."""
        t = time.perf_counter()
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # one bit per id, little-endian
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        self.mask_s = time.perf_counter() - t
        return allowed

    def consume(self, token: int) -> None:
        """Advance past ``token`` (sampled from the mask, or forced).

        Raises:
            InvalidRequestError: the grammar refuses it (a bug: the mask allowed it).
        """
        if not self.matcher.consume_token(int(token)):
            raise InvalidRequestError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows only one way from here (often none)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    @property
    def complete(self) -> bool:
        """True when the output so far is a whole document of the grammar."""
        return bool(self.matcher.is_accepting())

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens (a forced run the request cut before it reached the text)."""
        if n > 0:
            self.matcher.rollback(n)

    def accepts(self, text: str) -> bool:
        """True when ``text`` is a whole document: a fresh matcher walked along it. For a text a stop
        string (or stop ids) cut, which may end before, or inside, the ids the live matcher consumed."""
        matcher = _llguidance().LLMatcher(self.engine, self.grammar, log_level=0)  # a refusal is an answer here
        return bool(matcher.consume_tokens(self.engine.tokenize_str(text)) and matcher.is_accepting())

    def advance(self, token: int) -> list[int]:
        """Consume a sampled ``token`` (an EOS ends the request: nothing to consume), then the run
        the grammar forces after it, if any; return that run (consumed too)."""
        if self.matcher.is_stopped() or token in self.eos:
            return []
        self.consume(token)
        run = self.forced()
        for f in run:
            self.consume(f)
        return run


def incomplete(state: ConstraintState | None, reason, max_new_tokens: int, cut_text: str | None = None) -> str | None:
    """Why a constrained output is not a whole document (None when it is, or without a constraint).

    The matcher's state at the cut decides: the live matcher, which consumed exactly the output's ids
    (``Request`` rolls back a forced run cut short), or, when the stop chain cut the text short of its
    ids (``cut_text``: a stop string or stop ids), a matcher walked along that text."""
    if state is None or (state.complete if cut_text is None else state.accepts(cut_text)):
        return None
    return (
        f"the output stopped ({reason.value}) before its {state.constraint.kind} was complete, so it will not "
        f"parse; raise max_new_tokens (it was {max_new_tokens:,}) or loosen the stop conditions"
    )
