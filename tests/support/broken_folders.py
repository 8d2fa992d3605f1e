"""Broken model folders: a tiny, complete Llama folder to break one way at a time, and the tools to break it.

The cases of issue 7 (bad input gets a clear error, caught while loading) start from :func:`folder` (a
real folder: config.json, model.safetensors, word-level tokenizer files) and assert with
:func:`no_forward` that the forward pass never ran. Its fixtures are registered for the whole suite (``pytest_plugins`` in tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted import word_tokenizer_folder
from tiny_models import save, tiny_config, tiny_tensors

import minillm
from minillm.model.transformer import Transformer
from minillm.text.tokenizer import Tokenizer


@pytest.fixture
def folder(tmp_path) -> Path:
    """A complete tiny Llama folder: config.json, model.safetensors, tokenizer files (word-level)."""
    path = word_tokenizer_folder(tmp_path / "tiny")
    vocab = Tokenizer.from_folder(path).vocab_size
    (path / "config.json").write_text(json.dumps(tiny_config(vocab)))
    save(tiny_tensors(vocab), path / "model.safetensors")
    return path


@pytest.fixture
def no_forward(monkeypatch):
    """Any forward pass fails the test: errors must be caught while loading, before the model runs."""
    def forward(*args, **kwargs):
        raise AssertionError("the forward pass ran before the error was caught")

    monkeypatch.setattr(Transformer, "forward", forward)


@pytest.fixture(scope="module")
def wtok(tmp_path_factory) -> Tokenizer:
    """The word-level tokenizer of :func:`folder`, for scripted models."""
    return Tokenizer.from_folder(word_tokenizer_folder(tmp_path_factory.mktemp("words")))


def load(folder: Path):
    return minillm.load(folder, progress=False, warmup=True)


def rewrite(path: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header with ``edit(header)``; the data bytes stay as they are."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def shard(folder: Path, names: dict[str, str]) -> None:
    """Split model.safetensors into two shards and write the index; ``names`` renames shards in it."""
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": keys[:5], "model-00002-of-00002.safetensors": keys[5:]}
    weight_map = {}
    for file, part in parts.items():
        save({k: tensors[k] for k in part}, folder / file)
        weight_map |= {k: names.get(file, file) for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
