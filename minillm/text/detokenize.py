"""Ids -> text, all at once or one token at a time (streaming).

Decoding a whole list is easy: ``tokenizer.decode(ids)``. Streaming is where the traps are:

1. **Spaces.** Many tokens begin with a space ('Ġcapital', '▁Paris'), and some decoders strip
   the leading space of the *first* token they see. Decoding each token on its own then gives
   "Thecapitalof" instead of "The capital of" -- the classic bug.
2. **Half characters.** One character can span several tokens: '很' is the three bytes
   E5 BE 88, and byte-level / byte-fallback vocabularies may give each byte its own token.
   Decoding after the first byte yields '�' (U+FFFD); showing it would print garbage.

The fix, as in vLLM (``transformers_utils/detokenizer_utils.py: detokenize_incrementally``),
keeps two offsets into the token list::

    ids:     ... | prefix_offset ........ read_offset ........ end |
                   \\___ already shown ___/ \\__ not shown yet __/

    prefix_text = decode(ids[prefix_offset:read_offset])   # context, already emitted
    new_text    = decode(ids[prefix_offset:])              # context + pending tokens
    delta       = new_text[len(prefix_text):]

Decoding with a few tokens of context keeps the leading space; if ``new_text`` ends in '�'
the character is not finished, so we emit nothing and wait for the next token.

One known gap: tokenizers' ByteFallback decoder (SentencePiece-style vocabularies) turns a whole
run of byte tokens into '�'s if any byte in the run is invalid UTF-8, so a bad byte can rewrite
a good one already streamed ([<0x41>, <0x80>] decodes to '��'; a stream has shown 'A' first).
Text the model writes as valid UTF-8 streams exactly as the full decode.
"""

from __future__ import annotations

from collections.abc import Iterable

from minillm.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a decoder prints for bytes that are not (yet) a character
PROMPT_CONTEXT_TOKENS = 5  # how many prompt tokens to keep as context (vLLM uses 5 too)


def detokenize(tokenizer: Tokenizer, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Decode a whole id sequence (``int`` list or ``int64 [seq]`` array) to text.

    Special tokens (``<|im_end|>`` ...) are dropped unless ``skip_special_tokens=False``.
    Incomplete UTF-8 at the end decodes to U+FFFD. Raises TokenizerError for negative ids.
    """
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of text deltas that are safe to print.

    Guarantees: ``"".join(deltas) + flush()`` equals ``detokenize(all ids)`` (when no
    ``prompt_ids`` are given; see the module note on invalid byte runs); a delta never ends in
    a half-formed character.

    ``prompt_ids``: the prompt, used only as decoding context, so the first generated token
    keeps its leading space with decoders that strip it at the start of a text.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, prompt_ids=None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(i) for i in (prompt_ids if prompt_ids is not None else [])]
        context = [i for i in context if not self._hidden(i)]
        self._ids: list[int] = context  # prompt context + generated (visible) ids
        self.prefix_offset = max(len(context) - PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(context)
        self.token_ids: list[int] = []  # every generated id passed to add(), specials included
        self.text = ""  # everything emitted so far
        # Set by flush(): the stream ended on the first bytes of a character that never completed
        # (max_new_tokens cut it); the last delta then ends in U+FFFD, as the full decode does.
        self.ends_inside_character = False

    def _hidden(self, token_id: int) -> bool:
        return self.skip_special_tokens and token_id in self.tokenizer.special_token_ids

    def _pending_text(self) -> tuple[str, str]:
        prefix_text = self.tokenizer.decode(self._ids[self.prefix_offset : self.read_offset], skip_special_tokens=False)
        new_text = self.tokenizer.decode(self._ids[self.prefix_offset :], skip_special_tokens=False)
        return prefix_text, new_text

    def _emit(self, delta: str) -> str:
        # The pending tokens are now shown; they become the context for the next ones.
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the new text it completes (often "", never a half char)."""
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if self._hidden(token_id):  # a hidden special token adds no text and is no context either
            return ""
        self._ids.append(token_id)
        prefix_text, new_text = self._pending_text()
        # Hold back: an unfinished character ('�' at the end), or nothing new yet.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """Emit whatever is held back (end of stream). Never raises.

        A half character left at the end comes out as the full decode shows it (usually '�'),
        so ``"".join(deltas)`` still equals the full decode; ``ends_inside_character`` then says so.
        """
        try:
            prefix_text, new_text = self._pending_text()
        except Exception:  # a stream's last call must not fail; there is nothing sane to emit
            return ""
        if len(new_text) <= len(prefix_text):
            self.prefix_offset = self.read_offset = len(self._ids)
            return ""
        self.ends_inside_character = new_text.endswith(REPLACEMENT_CHAR)  # held back for a half character
        return self._emit(new_text[len(prefix_text) :])
