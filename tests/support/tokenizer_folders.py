"""Small tokenizer folders built on the spot for the tests (no download)."""

import json
from pathlib import Path


def byte_fallback_folder(path: Path) -> Path:
    """A Llama-2-style SentencePiece BPE: '▁' for spaces, 256 <0xNN> byte tokens for anything
    else, and the decoder chain Replace('▁',' ') -> ByteFallback -> Fuse -> Strip(1 leading space)."""
    from tokenizers import Tokenizer as Backend, decoders, normalizers
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [("▁", "P"), ("▁P", "a"), ("r", "i"), ("▁Pa", "ri"), ("▁Pari", "s")]
    for piece in ["▁", "P", "a", "r", "i", "s", ".", "▁P", "▁Pa", "ri", "▁Pari", "▁Paris"]:
        vocab[piece] = len(vocab)
    backend = Backend(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return path
