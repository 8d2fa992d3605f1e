"""What a Hugging Face-style model folder says about its tokenizer, for ``Tokenizer.from_folder``.

tokenizer.json          the vocabulary, merges, pre-tokenizer and decoder (required)
tokenizer_config.json   the special tokens by name and, usually, the chat template
chat_template.jinja     the template, where transformers 5 writes it
generation_config.json, config.json   more end-of-sequence ids (int or list; all unioned)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers

from minillm.errors import TokenizerError
from minillm.sources.json_file import read_json


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores a special token as "text" or as {"content": "text", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    """A JSON object file's fields; {} when the file is missing or holds another JSON value."""
    data = read_json(path, TokenizerError, missing=None, fix="re-download or re-convert the model folder")
    return data if isinstance(data, dict) else {}


def _id_list(value: Any) -> list[int]:
    """eos_token_id in config files is an int, a list of ints, or missing."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def read_tokenizer_folder(path: str | Path) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """``(backend, keywords)`` for ``Tokenizer(backend, **keywords)`` from a model folder: the special
    tokens by name, the extra end-of-sequence ids, the chat template(s) and the folder as ``source``.

    Raises TokenizerError if the folder or tokenizer.json is missing or unreadable, or a JSON file is invalid.
    """
    folder = Path(path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise TokenizerError(
            f"no tokenizer.json in {folder}; minillm needs the Hugging Face 'fast' tokenizer file. "
            "Download it with the model, or convert a GGUF with minillm.gguf_import"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception
        raise TokenizerError(f"cannot read {file}: {exc}; re-download or re-convert the model folder") from exc

    cfg = _read_json(folder / "tokenizer_config.json")
    # The special tokens a template sees by name (transformers' special_tokens_map).
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    special = {name: _token_content(cfg.get(name)) for name in names}
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, dict):  # Gemma 3: boi_token, eoi_token, image_token
        special.update({k: _token_content(v) for k, v in extra.items() if isinstance(k, str)})

    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: [{"name": "default", "template": ...}]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if not template and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        conf = _read_json(folder / name)
        eos += _id_list(conf.get("eos_token_id"))
        eos += _id_list(conf.get("text_config", {}).get("eos_token_id"))  # multimodal configs (Gemma 3)
    keywords = {"special_tokens": special, "extra_eos_ids": tuple(eos), "chat_template": template or None}
    return backend, {**keywords, "source": str(folder)}
