"""Chat templates: a list of messages -> the exact text an instruct model was trained on.

A chat template is a small Jinja program shipped with the model (``tokenizer_config.json`` or
``chat_template.jinja``) that turns ``[{"role": ..., "content": ...}]`` into text such as::

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n

Templates come from the internet, so they render in Jinja's immutable sandbox, as in
transformers (``utils/chat_template_utils.py``), with the same variables and helpers.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minillm.errors import ChatTemplateError

ROLES = ("system", "user", "assistant", "tool")


class ChatText(str):
    """Rendered chat text that remembers where the *messages* put special-token text.

    A user who types ``<|im_end|>`` into a message must not end the turn: that would let any
    text a user types steer the model with control tokens (prompt injection). So
    :meth:`Tokenizer.apply_chat_template` records the character spans of special-token text that
    came from message contents, and :meth:`Tokenizer.encode` keeps those as ordinary text. Only
    the template's own markers become control tokens. It is a ``str`` in every other way (slicing
    or concatenating gives a plain ``str``, which forgets the spans).
    """

    typed_special_spans: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, spans=()):
        obj = super().__new__(cls, text)
        obj.typed_special_spans = tuple(spans)
        return obj


# --- the chat-template sandbox ----------------------------------------------------------------
def _raise_exception(message: str):
    # A template calls this to refuse a conversation ("Conversation roles must alternate ...").
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Like transformers: Jinja's own tojson HTML-escapes '<' and '>', which would corrupt prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` for templates, refusing underscore names (a way to reach internals)."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def compile_chat_template(source: str) -> jinja2.Template:
    # trim_blocks / lstrip_blocks: the whitespace rules every HF chat template is written for.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template has a syntax error on line {exc.lineno}: {exc.message}; "
            "fix chat_template in tokenizer_config.json (or chat_template.jinja)"
        ) from exc


def _validate_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(
            f"messages must be a list of dicts, got {type(messages).__name__}; "
            'pass e.g. [{"role": "user", "content": "Hi"}]'
        )
    if not messages:
        raise ChatTemplateError('messages is empty; pass at least one, e.g. [{"role": "user", "content": "Hi"}]')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(
                f'message {i} is a {type(m).__name__}, not a dict; write it as {{"role": "user", "content": "..."}}'
            )
        if m.get("role") not in ROLES:
            raise ChatTemplateError(f"message {i} has role {m.get('role')!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(
                f"message {i} ({m['role']}) has content of type {type(m.get('content')).__name__}; "
                "content must be a string"
            )
    # Plain copies: the template never sees (or could touch) the caller's objects.
    return [dict(m) for m in messages]


def render_chat_template(
    template: jinja2.Template,
    messages: list[dict],
    *,
    special_tokens: dict[str, str],
    special_texts: re.Pattern | None,
    add_generation_prompt: bool = True,
) -> ChatText:
    """Render ``messages`` with a compiled template (:func:`compile_chat_template`).

    ``special_tokens``: the template's variables (``bos_token``, ``eos_token``, ...).
    ``special_texts``: a pattern matching special-token text; where a *message* contains such
    text it is hidden from the template and kept ordinary (see :class:`ChatText`). None renders
    the messages as given, as transformers does.

    Raises:
        ChatTemplateError: a malformed message, a template error or refusal (``raise_exception``),
            or a template that tries to reach Python internals.
    """
    messages = _validate_messages(messages)
    typed: list[str] = []  # special-token text found in the messages, in order
    marker = f"\ue000{secrets.token_hex(4)}."  # private-use characters + a nonce: never typed
    if special_texts is not None:

        def hide(match: re.Match) -> str:
            typed.append(match.group(0))
            return f"{marker}{len(typed) - 1}\ue001"

        messages = [
            {k: special_texts.sub(hide, v) if k != "role" and isinstance(v, str) else v for k, v in m.items()}
            for m in messages
        ]
    variables = {**special_tokens, "tools": None, "documents": None}
    try:
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(
            f"the chat template tried something the sandbox forbids ({exc}); "
            "the template is unsafe or broken: replace chat_template in tokenizer_config.json"
        ) from exc
    except Exception as exc:  # UndefinedError, TypeError in template expressions, ...
        raise ChatTemplateError(
            f"the chat template failed to render: {type(exc).__name__}: {exc}; "
            "check the messages against what this model's template expects"
        ) from exc
    if not typed:
        return ChatText(text)
    # Put the typed text back where its placeholders landed, remembering each span.
    pieces, spans, length, pos = [], [], 0, 0
    for m in re.finditer(re.escape(marker) + r"(\d+)\ue001", text):
        pieces.append(text[pos : m.start()])
        length += m.start() - pos
        original = typed[int(m.group(1))]
        pieces.append(original)
        spans.append((length, length + len(original)))
        length += len(original)
        pos = m.end()
    pieces.append(text[pos:])
    return ChatText("".join(pieces), spans)
