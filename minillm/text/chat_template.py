"""Chat templates: a list of messages -> the exact text an instruct model was trained on.

A chat template is a small Jinja program shipped with the model (``tokenizer_config.json`` or
``chat_template.jinja``) that turns ``[{"role": ..., "content": ...}]`` into text such as::

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n

Templates come from the internet, so they render in Jinja's immutable sandbox. Everything else
follows transformers (``utils/chat_template_utils.py: render_jinja_template`` and
``tokenization_utils_base.py: apply_chat_template``), so a template renders here exactly as there:

- the variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special
  tokens by name (``bos_token`` ...), and any extra keyword (``enable_thinking=False`` ...);
- the helpers: ``raise_exception``, ``strftime_now``, ``namespace``, ``dict``, a ``tojson`` that
  does not HTML-escape and takes ``indent`` / ``separators`` / ``sort_keys`` / ``ensure_ascii``,
  the ``{% generation %}...{% endgeneration %}`` tag (marks the assistant's text; renders its body);
- the message clean-up: keys whose value is None are dropped, a message's reasoning given as
  ``thinking`` / ``reasoning`` is also offered as ``reasoning_content`` (and the reverse);
- ``continue_final_message``: the last message is left open, so the model continues it.

The template decides which roles and contents it accepts; its own refusals
(``raise_exception("...")``) come back as :class:`~minillm.errors.ChatTemplateError` carrying the
template's message.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minillm.errors import ChatTemplateError

# transformers appends this to the final message, renders, then cuts the text at it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning is passed under; templates read the first (transformers' order).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatText(str):
    """Rendered chat text that remembers where the *messages* put special-token text.

    A user who types ``<|im_end|>`` into a message must not end the turn: that would let any
    text a user types steer the model with control tokens (prompt injection). So
    :meth:`Tokenizer.apply_chat_template` records the character spans of special-token text that
    came from message contents (or tools, documents, extra variables), and :meth:`Tokenizer.encode`
    keeps those as ordinary text. Only the template's own markers become control tokens. It is a
    ``str`` in every other way (slicing or concatenating gives a plain ``str``, which forgets the
    spans).
    """

    typed_special_spans: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, spans=()):
        obj = super().__new__(cls, text)
        obj.typed_special_spans = tuple(spans)
        return obj


# --- the chat-template sandbox ----------------------------------------------------------------
class _TemplateRefusal(Exception):
    """``raise_exception(message)`` inside a template: the template refuses the conversation."""


def _raise_exception(message: str):
    # A template calls this to refuse a conversation ("Conversation roles must alternate ...").
    raise _TemplateRefusal(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Like transformers: Jinja's own tojson HTML-escapes '<' and '>', which would corrupt prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Templates date their system prompt with this ("Today Date: 26 Jul 2024" in Llama 3.1).
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without handing them the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


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


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's own text (SmolLM3 and
    others, for training masks). Rendering a prompt only needs the body, as transformers renders it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and its source (transformers checks the source for field names)."""

    source: str
    template: jinja2.Template


def compile_chat_template(source: str, *, where: str = "chat_template in tokenizer_config.json") -> ChatTemplate:
    """Compile a template once (at load), so a broken template fails before any request.

    Raises:
        ChatTemplateError: not a string, or a Jinja syntax error (line and message), naming ``where``.
    """
    if not isinstance(source, str):
        raise ChatTemplateError(f"{where} is a {type(source).__name__}, not a string; it must hold a Jinja template")
    # trim_blocks / lstrip_blocks: the whitespace rules every HF chat template is written for.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return ChatTemplate(source, env.from_string(source))
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template has a syntax error on line {exc.lineno}: {exc.message}; fix {where}"
        ) from exc


# --- what the template sees -------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A fresh copy built of JSON types only (transformers' ``_plain_template_data``): the
    template never touches the caller's objects, nor methods of rich ones."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"  # anything else: an inert placeholder naming its type


def _validate_messages(messages: Any) -> list[dict]:
    """Messages as transformers gives them to a template: plain copies, None values dropped,
    reasoning aliased. Roles and content types are the template's business, not checked here."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(
            f"messages must be a list of dicts, got {type(messages).__name__}; "
            'pass e.g. [{"role": "user", "content": "Hi"}]'
        )
    if not messages:
        raise ChatTemplateError('messages is empty; pass at least one, e.g. [{"role": "user", "content": "Hi"}]')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(
                f'message {i} is a {type(m).__name__}, not a dict; write it as {{"role": "user", "content": "..."}}'
            )
        # APIs send content=None / tool_calls=None; templates handle a missing key, not a None.
        m = {k: v for k, v in _plain(m).items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _validate_list_of_dicts(value: Any, name: str) -> list | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, dict) for v in value):
        raise ChatTemplateError(
            f"{name} must be a list of dicts (JSON schemas for tools; {{'title', 'text'}} for documents), "
            f"got {type(value).__name__}"
        )
    return _plain(list(value))


class _Hider:
    """Swaps special-token text found in user data for private placeholders, and back.

    Placeholders are private-use characters plus a per-render nonce, so no one can type one.
    """

    def __init__(self, pattern: re.Pattern | None):
        self.pattern = pattern
        self.typed: list[str] = []
        self.marker = f"\ue000{secrets.token_hex(4)}."

    def _sub(self, match: re.Match) -> str:
        self.typed.append(match.group(0))
        return f"{self.marker}{len(self.typed) - 1}\ue001"

    def hide(self, value: Any, *, keys: bool = False) -> Any:
        """Hide inside strings, recursively through dicts (values only) and lists."""
        if self.pattern is None:
            return value
        if isinstance(value, str):
            return self.pattern.sub(self._sub, value)
        if isinstance(value, dict):
            return {k: (v if k == "role" else self.hide(v)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.hide(v) for v in value)
        return value

    def restore(self, text: str) -> ChatText:
        if not self.typed:
            return ChatText(text)
        pieces, spans, length, pos = [], [], 0, 0
        for m in re.finditer(re.escape(self.marker) + r"(\d+)\ue001", text):
            pieces.append(text[pos : m.start()])
            length += m.start() - pos
            original = self.typed[int(m.group(1))]
            pieces.append(original)
            spans.append((length, length + len(original)))
            length += len(original)
            pos = m.end()
        pieces.append(text[pos:])
        return ChatText("".join(pieces), spans)


def _open_final_message(messages: list[dict], field: str | bool, source: str) -> tuple[list[str], str]:
    """Tag the final message's ``field`` (transformers' continue_final_message); returns the
    tagged field names and the text to continue."""
    field = field if isinstance(field, str) else "content"
    final = messages[-1].get(field)
    if final is None:
        raise ChatTemplateError(
            f'continue_final_message is set but the final message has no "{field}" to continue; '
            "end the messages with the (partial) assistant message to continue"
        )
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is offered under several names: tag each copy
        fields = [f for f in _REASONING_FIELDS if messages[-1].get(f) == final]
    if not any(f in source for f in fields):
        raise ChatTemplateError(
            f'continue_final_message names "{field}", which this chat template never reads; '
            "continue a field the template uses (usually content)"
        )
    if isinstance(final, (list, tuple)):  # content blocks: continue the last text block
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return fields, text
        raise ChatTemplateError("continue_final_message is set but the final message has no text block to continue")
    for f in fields:
        messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    return fields, final


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered chat up to where the final message ended (transformers' rule, to the letter)."""
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the rendered chat "
            "(the template changed or dropped it); this template cannot continue that message"
        )
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]  # the template kept the message's spacing
    return text[:at].rstrip()  # it trimmed trailing space: cut more cautiously


def render_chat_template(
    template: ChatTemplate,
    messages: list[dict],
    *,
    special_tokens: dict[str, str],
    special_texts: re.Pattern | None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | str = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatText:
    """Render ``messages`` with a compiled template (:func:`compile_chat_template`), as
    transformers' ``apply_chat_template(..., tokenize=False)`` renders them.

    ``special_tokens``: the template's variables (``bos_token``, ``eos_token``, ...).
    ``special_texts``: a pattern matching special-token text; where user data (messages, tools,
    documents, ``template_kwargs`` values) contains such text it is hidden from the template and
    kept ordinary (see :class:`ChatText`). None renders the data as given, as transformers does.
    ``add_generation_prompt``: open the assistant's turn; None means "unless continuing".
    ``continue_final_message``: True (or the field name, e.g. ``"reasoning_content"``) leaves the
    last message open: the text ends where its content ends, with no end-of-turn marker.
    ``tools`` / ``documents``: lists of dicts (JSON schemas; ``{"title", "text"}``).
    ``template_kwargs``: extra variables (``enable_thinking`` ...); they override special tokens.

    Raises:
        ChatTemplateError: malformed messages / tools / documents, ``continue_final_message``
            with ``add_generation_prompt``, a final message the template does not keep, the
            template's own refusal (``raise_exception``; its message is kept), a render error,
            or a template that tries to reach Python internals.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be set: the first continues the "
            "last message, the second opens a new assistant turn; pass add_generation_prompt=False"
        )
    add_generation_prompt = not continue_final_message if add_generation_prompt is None else add_generation_prompt
    messages = _validate_messages(messages)
    tools = _validate_list_of_dicts(tools, "tools")
    documents = _validate_list_of_dicts(documents, "documents")
    hider = _Hider(special_texts)
    messages = hider.hide(messages)
    tools, documents = hider.hide(tools), hider.hide(documents)
    extra = hider.hide(_plain(dict(template_kwargs or {})))
    final = None
    if continue_final_message:
        _, final = _open_final_message(messages, continue_final_message, template.source)
    variables = {**special_tokens, **extra}  # extra variables override special tokens, as in transformers
    try:
        text = template.template.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=bool(add_generation_prompt),
            **variables,
        )
    except _TemplateRefusal as exc:
        raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
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
    if final is not None:
        text = _cut_at_tag(text, final)
    return hider.restore(text)
