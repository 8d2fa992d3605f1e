"""GGUF vocabulary -> a Hugging Face ``tokenizers.Tokenizer`` (what becomes ``tokenizer.json``).

A GGUF keeps its tokenizer as metadata arrays: ``tokenizer.ggml.tokens`` (the pieces, by id),
``token_type`` (normal, control, user-defined, byte, ...), ``scores`` and, for byte-level BPE,
``merges``. ``tokenizer.ggml.model`` says which of two kinds it is; both become a BPE model:

- ``gpt2``: byte-level BPE (GPT-2, Llama 3, SmolLM2). Every byte is a printable character, merges
  come with the file, and a pre-tokenizer regex (``tokenizer.ggml.pre``) splits words first.
- ``llama``: SentencePiece-style BPE (Llama 2, Gemma). Spaces are written ``▁``, bytes missing
  from the vocabulary fall back to ``<0xNN>`` pieces, and there are no merges in the file: they
  are rebuilt from the scores (a SentencePiece BPE merges the pair whose result scores highest).

Gemma's GGUF needs two repairs before its merges come out as Google's ``tokenizer.json`` has them
(checked merge for merge in ``tests/model/test_gemma3.py`` against an independent copy of that file):

1. llama.cpp writes the space-run tokens (ids 138-167: two to 31 spaces) with real spaces; the
   vocabulary spells them ``▁▁``... like every other piece. We respell them.
2. llama.cpp gives every user-defined token (space, tab and newline runs, HTML tags: 165 of them)
   the score -1000, where Google's SentencePiece model has 0, the highest there is. With -1000,
   the merges that build space runs rank below the ordinary ones, so a space run next to a word
   loses its last space to the word: "    return" becomes ``▁▁▁`` + ``▁return`` instead of Google's
   ``▁▁▁▁`` + ``return``, and "a  b" becomes a, ``▁``, ``▁b``. (A bare run of 34 spaces splits
   31 + 3 either way.) With the 0 put back, every merge lands where Google's list has it.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

from minillm.errors import GGUFError

SPIECE_SPACE = "▁"  # U+2581, how SentencePiece writes a space inside a piece
_PLACEHOLDER = re.compile(r"^<unused\d+>$")  # reserved ids, marked control by llama.cpp


# --- tokenizer pre-splitting rules for byte-level BPE (tokenizer.ggml.pre -> pre-tokenizer builder) ---
def _gpt2_pre_tokenizer():
    from tokenizers import pre_tokenizers

    # GPT-2's regex: 's|'t|... | ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+, then bytes -> chars
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_pre_tokenizer():
    from tokenizers import pre_tokenizers

    # llama.cpp's 'smollm' splits off every \p{N} character first, then applies GPT-2's regex; the
    # real SmolLM2 tokenizer.json says the same with Digits(individual_digits=True). So each digit,
    # and a character like "½", is its own piece, never glued to a leading space as in GPT-2's
    # " ?\p{N}+". (transformers' GGUF loader does not know 'smollm': " = ½" differs there.)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre_tokenizer()])


PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "gpt2": _gpt2_pre_tokenizer,
    "default": _gpt2_pre_tokenizer,
    "smollm": _smollm_pre_tokenizer,
}


def build_tokenizer(path, meta: dict):
    """A ``tokenizers.Tokenizer`` from a GGUF's metadata; returns (tokenizer, a one-line description).

    Raises GGUFError for a tokenizer kind other than ``gpt2`` / ``llama``, a duplicated token, or
    a malformed merge.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if len(set(tokens)) != len(tokens):
        dup = next(t for t, n in Counter(tokens).items() if n > 1)
        raise GGUFError(f"{path.name}: token {dup!r} appears twice in the vocabulary; cannot build BPE")
    if kind == "gpt2":
        return _byte_level_bpe(path, meta, tokens)
    if kind == "llama":
        return _sentencepiece_bpe(path, meta, tokens)
    raise GGUFError(
        f"{path.name}: tokenizer.ggml.model {kind!r} is not supported yet (minillm builds byte-level "
        "BPE, 'gpt2', and SentencePiece-style BPE, 'llama'); pick a GGUF with one of those"
    )


def _token_types(meta: dict, n: int) -> list[int]:
    import gguf

    return list(meta.get("tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * n)


def _add_control_and_user_tokens(tok, pieces: list[str], types: list[int]) -> None:
    """Control tokens (``<|im_start|>``, ``<bos>``) are matched whole and dropped by
    skip_special_tokens; user-defined ones (``<think>``, Gemma's ``\\n\\n``) are matched whole
    but kept when decoding. llama.cpp marks reserved ``<unusedN>`` slots as control too; they are
    placeholders, not specials (Google's tokenizer.json agrees), so they go with the kept ones."""
    import gguf
    from tokenizers import AddedToken

    control = [
        p for p, k in zip(pieces, types, strict=True) if k == gguf.TokenType.CONTROL and not _PLACEHOLDER.match(p)
    ]
    kept = [
        p
        for p, k in zip(pieces, types, strict=True)
        if k == gguf.TokenType.USER_DEFINED or (k == gguf.TokenType.CONTROL and _PLACEHOLDER.match(p))
    ]
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in kept])


# --- byte-level BPE ---------------------------------------------------------------------------------
def _byte_level_bpe(path, meta: dict, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, processors

    types = _token_types(meta, len(tokens))
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    if any(len(m) != 2 for m in merges):
        raise GGUFError(f"{path.name}: a merge is not 'left right': {next(m for m in merges if len(m) != 2)}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        warnings.warn(
            f"{path.name}: unknown tokenizer.ggml.pre {pre!r}; using GPT-2's split, which may tokenize "
            "some text differently from the original model (add it to gguf_tokenizer.PRE_TOKENIZERS)",
            stacklevel=4,
        )
    used = pre if pre in PRE_TOKENIZERS else f"default (unknown {pre!r})"
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"])()
    tok.decoder = decoders.ByteLevel()
    # Offsets only: this post-processor adds no tokens (SmolLM2's GGUF says add_bos_token false).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    _add_control_and_user_tokens(tok, tokens, types)
    return tok, used


# --- SentencePiece-style BPE ------------------------------------------------------------------------
def merges_from_scores(pieces: list[str], scores: list[float], skip: set[int] = frozenset()) -> list[tuple[str, str]]:
    """Rebuild BPE merges from a SentencePiece vocabulary: ``[(left, right), ...]``, best first.

    Every piece that can be cut into two pieces of the vocabulary gives one merge per cut. A
    SentencePiece BPE model applies the merge whose *result* has the highest score, so merges are
    ranked by that score; ties go to the longer left part, then the longer right part, then the
    smaller ids (the order of transformers' ``generate_merges``, which gives Gemma's merge list
    exactly). Pieces whose id is in ``skip`` (control, byte, unused) are never merge results.
    """
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for i, piece in enumerate(pieces):
        if i in skip:
            continue
        cuts = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        cuts = sorted(
            ((left, right) for left, right in cuts if left in vocab and right in vocab),
            key=lambda lr: (vocab[lr[0]], vocab[lr[1]]),
        )
        merges.extend((scores[i], left, right) for left, right in cuts)
    # Python's sort is stable, also with reverse=True: equal keys keep the id order built above.
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


def _sentencepiece_bpe(path, meta: dict, tokens: list[str]):
    import gguf
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    types = _token_types(meta, len(tokens))
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise GGUFError(
            f"{path.name}: {len(tokens)} tokens but {len(scores)} scores and {len(types)} types; "
            "the tokenizer metadata is inconsistent"
        )
    # Repair 1 (module docstring): a run of real spaces is a run of '▁' in every other spelling.
    pieces = [SPIECE_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    # Repair 2: user-defined tokens score 0 in the original SentencePiece model, not -1000.
    scores = [0.0 if k == gguf.TokenType.USER_DEFINED else float(s) for s, k in zip(scores, types, strict=True)]
    not_merged = {gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN, gguf.TokenType.BYTE, gguf.TokenType.UNUSED}
    skip = {i for i, k in enumerate(types) if k in not_merged}
    merges = merges_from_scores(pieces, scores, skip)

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return pieces[i] if isinstance(i, int) and 0 <= i < len(pieces) else None

    unk = special("unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab={p: i for i, p in enumerate(pieces)}, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    # Spaces become '▁' before the model sees the text; a Llama 2-style vocabulary also wants one
    # in front of the first word (add_space_prefix, llama.cpp's default), Gemma's does not.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", SPIECE_SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    bos, eos = special("bos_token_id"), special("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:  # Gemma: "<bos> text", as tokenizer.json's TemplateProcessing says
        head, tail = ([bos] if add_bos else []), ([eos] if add_eos else [])
        second = [f"{t}:1" for t in head] + ["$B:1"] + [f"{t}:1" for t in tail]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(head + ["$A"] + tail),
            pair=" ".join(head + ["$A"] + tail + second),
            special_tokens=[(t, pieces.index(t)) for t in dict.fromkeys(head + tail)],
        )
    _add_control_and_user_tokens(tok, pieces, types)
    fixed = sum(1 for k in types if k == gguf.TokenType.USER_DEFINED)
    return tok, f"sentencepiece-bpe ({len(merges):,} merges rebuilt from scores; {fixed} user-defined scores set to 0)"
