"""A token's piece and its bytes: GPT-2's byte-level alphabet, SentencePiece's ``▁`` and ``<0xE5>``,
and the visible glyphs ``piece_for_display`` shows for white space."""

from __future__ import annotations

import re
from typing import Any

# How piece_for_display makes invisible characters visible.
VISIBLE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"})
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback token


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE writes every byte as a char).

    Printable bytes map to themselves; the rest (space, newline, control bytes, ...) are shifted
    to 256+, which is why a space shows up as 'Ġ' (256 + 32) and a newline as 'Ċ' (256 + 10).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_LEVEL_DECODER = {ch: b for b, ch in _bytes_to_unicode().items()}


def uses(node: Any, kind: str) -> bool:
    """True if a tokenizer.json component (possibly a Sequence of them) has type ``kind``."""
    if isinstance(node, dict):
        return node.get("type") == kind or any(uses(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(uses(v, kind) for v in node)
    return False


def piece_bytes(piece: str, byte_level: bool) -> bytes:
    """The bytes an ordinary vocabulary piece stands for: ``<0xE5>`` -> ``b"\\xe5"``; a byte-level piece
    (``byte_level`` tokenizers, every character in GPT-2's alphabet) -> its bytes; else the text with
    ``▁`` read as a space, as UTF-8."""
    if m := _BYTE_PIECE.match(piece):
        return bytes([int(m.group(1), 16)])
    if byte_level and all(ch in _BYTE_LEVEL_DECODER for ch in piece):
        return bytes(_BYTE_LEVEL_DECODER[ch] for ch in piece)
    return piece.replace("▁", " ").encode("utf-8")
