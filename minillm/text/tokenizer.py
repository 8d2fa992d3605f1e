"""Text <-> token ids, and chat messages -> text.

A model never sees text. It sees integer ids, and the folder that holds the weights also holds
the recipe for turning text into ids:

    tokenizer.json          the vocabulary, merges, pre-tokenizer and decoder (Hugging Face
                            ``tokenizers`` format; we run it with the ``tokenizers`` library)
    tokenizer_config.json   the special tokens by name (bos, eos, ...) and, usually, the chat
                            template (some folders keep it in ``chat_template.jinja`` instead)
    generation_config.json  more end-of-sequence ids (an instruct model often stops on several)
    config.json             the model's own ``eos_token_id``

A chat template is a small Jinja program shipped with the model that turns a list of
``{"role": ..., "content": ...}`` messages into the exact text the model was trained on::

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n

Templates come from the internet, so they render in Jinja's immutable sandbox, as in
transformers (``utils/chat_template_utils.py``), with the same variables and helpers.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path

import numpy as np
import tokenizers

from minillm.errors import ChatTemplateError, InvalidRequestError, TokenizerError
from minillm.text.chat_template import ChatTemplate, ChatText, compile_chat_template, render_chat_template
from minillm.text.pieces import VISIBLE, piece_bytes, uses
from minillm.text.tokenizer_folder import read_tokenizer_folder

_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: not a character, has no UTF-8


def check_encodable(text: str, what: str = "the text") -> None:
    """Raise InvalidRequestError naming the position of a lone surrogate (U+D800..U+DFFF) in ``text``.

    Python strings can hold them (a JSON escape like ``"\\ud800"``, or an emoji cut between its
    two UTF-16 halves); they are not characters, have no UTF-8 bytes, and ``tokenizers`` fails on
    them with a bare TypeError.
    """
    if (m := _SURROGATE.search(text)) is not None:
        i = m.start()
        raise InvalidRequestError(
            f"{what} holds a lone surrogate U+{ord(m.group()):04X} at character {i} "
            f"(around {text[max(i - 10, 0) : i + 10]!r}); it is half of a UTF-16 pair, not a character, and has "
            "no UTF-8 bytes. Remove it, or clean the text with text.encode('utf-8', 'replace').decode()"
        )


class Tokenizer:
    """tokenizers.Tokenizer + chat template (sandboxed jinja2) + special tokens.

    Build one with :meth:`from_folder`. Ids are ``np.ndarray`` of ``int64``, shape ``[seq]``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str | None] | None = None,
        extra_eos_ids: tuple[int, ...] = (),
        chat_template: str | dict[str, str] | None = None,
        source: str = "<memory>",
    ):
        self.backend = backend
        self.source = source
        # One template, or several by name ({"default": ..., "tool_use": ...}): transformers picks
        # "tool_use" when tools are passed, else "default".
        named = chat_template if isinstance(chat_template, dict) else {"default": chat_template}
        self.chat_templates: dict[str, str] = {k: v for k, v in named.items() if v}
        self.chat_template: str | None = self.chat_templates.get("default")
        # Compiled now, so a broken template fails at load, not at the first chat request.
        where = f"chat_template in {source}/tokenizer_config.json (or chat_template.jinja)"
        self._templates: dict[str, ChatTemplate] = {
            name: compile_chat_template(text, where=f"{where}, template {name!r}" if len(named) > 1 else where)
            for name, text in self.chat_templates.items()
        }
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

        self.bos_token = self.special_tokens.get("bos_token")
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token = self.special_tokens.get("eos_token")
        eos = set(extra_eos_ids)
        if self.eos_token and backend.token_to_id(self.eos_token) is not None:
            eos.add(backend.token_to_id(self.eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

        self._added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        special = {i for i, tok in self._added.items() if tok.special}
        for content in self.special_tokens.values():
            if (i := backend.token_to_id(content)) is not None:
                special.add(i)
        self.special_token_ids: frozenset[int] = frozenset(special)

        # Special added tokens: the tokenizer cuts these out of any text before BPE runs. Their
        # text inside a chat message is what the message sandboxing below keeps ordinary.
        texts = sorted({t.content for t in self._added.values() if t.special and t.content}, key=len, reverse=True)
        self._special_texts = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._backend_special_ids = frozenset(i for i, t in self._added.items() if t.special)

        spec = json.loads(backend.to_str())
        self._byte_level = uses(spec.get("decoder"), "ByteLevel") or uses(spec.get("pre_tokenizer"), "ByteLevel")

    # --- loading --------------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Read a Hugging Face-style model folder.

        Uses tokenizer.json (required), tokenizer_config.json (special tokens, chat template),
        chat_template.jinja (transformers 5 writes the template there), and the ``eos_token_id``
        of generation_config.json and config.json (int or list; all are unioned).

        Raises TokenizerError if the folder or tokenizer.json is missing or unreadable.
        """
        backend, keywords = read_tokenizer_folder(path)
        return cls(backend, **keywords)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos_ids={sorted(self.eos_token_ids)}, chat_template={self.chat_template is not None})"
        )

    # --- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """Text -> ids, ``int64 [seq]``.

        Raises InvalidRequestError for a lone surrogate (``"a\\ud800b"``), naming its position.
        ``add_special_tokens`` runs the tokenizer's post-processor (which may prepend BOS, e.g.
        Llama 3, Gemma); rendered chat text already contains its specials, so pass False there
        (or use :meth:`encode_chat`). Special-token text such as ``<|im_end|>`` inside ``text``
        becomes the special id, as in transformers, except in a :class:`ChatText` from
        :meth:`apply_chat_template`: there, special-token text that came from a message stays
        ordinary text (see :meth:`_encode_keeping_typed_text`).
        """
        if not isinstance(text, str):
            raise TokenizerError(
                f"encode() takes a string, got {type(text).__name__}; for chat messages use encode_chat()"
            )
        check_encodable(text)
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if isinstance(text, ChatText) and text.typed_special_spans:
            ids = self._encode_keeping_typed_text(text, encoding)
        return np.asarray(ids, dtype=np.int64)  # [seq]

    @cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads special-token text as ordinary text (``<|`` ``im`` ...)."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def _encode_keeping_typed_text(self, text: ChatText, encoding) -> list[int]:
        """Re-encode, as plain text, each stretch between two of the template's own special tokens
        that holds special-token text typed into a message.

        The template's markers stay the boundaries, so every other token is the one a plain
        ``encode`` gives; inside a re-encoded stretch a typed ``<|im_end|>`` becomes ordinary
        pieces (``<``, ``|``, ``im``, ``_``, ``end`` ... in SmolLM2).
        """
        ids, offsets, spans = encoding.ids, encoding.offsets, text.typed_special_spans

        def typed(k: int) -> bool:  # a special id whose characters a message typed
            start, end = offsets[k]
            return ids[k] in self._backend_special_ids and any(start < e and s < end for s, e in spans)

        boundary = [ids[k] in self._backend_special_ids and not typed(k) for k in range(len(ids))]
        out: list[int] = []
        k = 0
        while k < len(ids):
            if boundary[k]:  # the template's own marker (or the post-processor's BOS): kept
                out.append(ids[k])
                k += 1
                continue
            first = k
            while k < len(ids) and not boundary[k]:
                k += 1
            if not any(typed(j) for j in range(first, k)):
                out.extend(ids[first:k])
                continue
            start = offsets[first - 1][1] if first > 0 else 0
            end = offsets[k][0] if k < len(ids) else len(text)
            out.extend(self._plain_backend.encode(str(text)[start:end], add_special_tokens=False).ids)
        return out

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Ids (any int sequence or array) -> text. Special tokens dropped unless asked for.

        Bytes that do not complete a UTF-8 character decode to U+FFFD ('�'), as in transformers.
        Raises TokenizerError for a negative id.
        """
        ids = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
        if any(i < 0 for i in ids):
            raise TokenizerError(f"token ids must be >= 0, got {min(ids)}")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_token_ids]
        return self.backend.decode(ids, skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        """The raw vocabulary entry, e.g. 'Ġcapital' (byte-level BPE) or '▁capital' (SentencePiece).

        Raises TokenizerError for an id the tokenizer does not have (negative, or a padded row of
        the model's embedding: see :meth:`piece_for_display`).
        """
        piece = self.backend.id_to_token(int(token_id)) if int(token_id) >= 0 else None
        if piece is None:
            raise TokenizerError(f"token id {token_id} is not in the vocabulary (size {self.vocab_size})")
        return piece

    def piece_for_display(self, token_id: int) -> str:
        """A piece as a person reads it: 'Ġcapital' -> '␣capital', 'Ċ' -> '↵', '<|im_end|>' as-is.

        The piece is turned back into its bytes (:meth:`token_bytes`); bytes that are only part of
        a UTF-8 character are shown escaped, e.g. '\\xe5'.

        An id >= 0 with no entry shows as ``<id 287>``: models pad their embedding past the
        tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens; rows are rounded up for fast matrix
        shapes), so the model can score, and emit, ids that have no text. Such an id decodes to ""
        (as in transformers, which skips it). Raises TokenizerError for a negative id.
        """
        token_id = int(token_id)
        if token_id >= 0 and self.backend.id_to_token(token_id) is None:
            return f"<id {token_id}>"
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace").translate(VISIBLE)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: 'Ġcapital' -> b' capital', '<0xE5>' -> b'\\xe5', the
        byte-level piece 'ðŁİ' -> b'\\xf0\\x9f\\x8e' (part of a character: bytes, not text),
        '▁capital' -> b' capital', a special or added token -> its text's UTF-8.

        Joined over a byte-level tokenizer's ids, they are the decoded text's UTF-8 exactly. An id
        >= 0 with no entry (a padded embedding row) has no bytes: b''. Raises TokenizerError for a
        negative id.
        """
        token_id = int(token_id)
        if token_id >= 0 and self.backend.id_to_token(token_id) is None:
            return b""
        piece = self.id_to_piece(token_id)
        if token_id in self.special_token_ids:
            return piece.encode("utf-8")
        if token_id in self._added:  # added tokens hold plain text (Gemma's space runs: '▁▁▁')
            return piece.replace("▁", " ").encode("utf-8")
        return piece_bytes(piece, self._byte_level)

    @cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        """The text of every special token (``<|im_end|>``, ...), in id order; computed once."""
        return tuple(self.decode([i], skip_special_tokens=False) for i in sorted(self.special_token_ids))

    # --- chat ----------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | str = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        allow_special_tokens_in_messages: bool = False,
        **template_kwargs,
    ) -> ChatText:
        """Render messages with the model's chat template (sandboxed), exactly as transformers'
        ``apply_chat_template(messages, tokenize=False, ...)`` renders them with the same arguments.

        ``messages``: ``[{"role": ..., "content": ...}, ...]``; which roles and contents are valid
        is the template's decision (tool calls, content blocks, ``reasoning_content`` all pass).
        ``add_generation_prompt`` appends the header that opens the assistant's turn; the default
        (None) means True, or False with ``continue_final_message`` (transformers' default is False).
        ``continue_final_message=True`` leaves the last message open for the model to continue
        (assistant prefill): ``...<|im_start|>assistant\nThe capital of France is``, no end marker.
        ``tools`` (JSON schemas), ``documents`` (``{"title", "text"}`` dicts) and any other keyword
        (``enable_thinking=False`` for Qwen 3 ...) are the template's variables, as in transformers.
        With several named templates, ``tools`` selects ``"tool_use"`` if there is one.

        Special-token text inside a message (a user typing ``<|im_end|>``) is shown as typed but
        encodes as ordinary text: the result is a :class:`ChatText` that remembers where it is.
        (While rendering, the template sees a private placeholder there, so a typed marker cannot
        change its branches either.) The same holds for tools, documents and extra keywords.
        ``allow_special_tokens_in_messages=True`` renders the text as given and lets it become
        control tokens, as transformers does by default.

        Raises ChatTemplateError: no template, malformed messages, incompatible options, the
        template's own refusal (``raise_exception``, with its message) or render error, or a
        template that tries to reach Python internals.
        """
        if not self._templates:
            raise ChatTemplateError(
                f"the model in {self.source} has no chat template (it is probably a base model); "
                "use completion mode: pass plain text instead of messages"
            )
        name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        if name not in self._templates:
            raise ChatTemplateError(
                f"the model in {self.source} has chat templates {sorted(self._templates)} but none named "
                "'default'; add a default template to tokenizer_config.json"
            )
        return render_chat_template(
            self._templates[name],
            messages,
            special_tokens=self.special_tokens,
            special_texts=None if allow_special_tokens_in_messages else self._special_texts,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            template_kwargs=template_kwargs,
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool | None = None,
        *,
        allow_special_tokens_in_messages: bool = False,
        **chat_options,
    ) -> np.ndarray:
        """Render (:meth:`apply_chat_template`, same options) then encode with
        ``add_special_tokens=False``, ``int64 [seq]``; the ids transformers'
        ``apply_chat_template(..., tokenize=True)`` gives.

        The rendered text already holds the BOS / turn markers; letting the post-processor add
        another BOS would give the model a sequence it never saw in training. Special-token text
        typed into a message stays ordinary text unless ``allow_special_tokens_in_messages``.
        """
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            allow_special_tokens_in_messages=allow_special_tokens_in_messages,
            **chat_options,
        )
        return self.encode(text, add_special_tokens=False)
