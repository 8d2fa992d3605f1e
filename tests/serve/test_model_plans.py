"""The registry's plans (serve/models.py) are made from config.json and the tokenizer: no weight is read."""

from __future__ import annotations

import socket

import pytest

import minillm
from minillm.errors import MemoryBudgetError
from minillm.model import weights as weights_module
from minillm.serve.metrics import ServerMetrics
from minillm.serve.models import ModelRegistry, ModelSpec
from minillm.sources import hub


@pytest.fixture(scope="module")
def smollm2_cached():
    """SmolLM2 in minillm's cache (fetched and converted on first use) and its GGUF, not loaded."""
    hub.resolve_gguf("smollm2-135m-instruct", progress=False)
    return hub.resolve_model("smollm2-135m-instruct", progress=False)


@pytest.fixture
def nothing_heavy(monkeypatch, smollm2_cached):
    """Reading weights, loading, fetching or connecting fails the test."""
    attempts = []

    def forbidden(*a, **k):
        raise AssertionError("a plan must not read, fetch or load weights")

    for owner, name in ((weights_module, "load_weights"), (minillm, "load"), (hub, "_build"), (hub, "resolve_model")):
        monkeypatch.setattr(owner, name, forbidden)
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: attempts.append(address))
    return attempts


def test_plans_read_configs_only_and_a_budget_refuses_before_any_weight(nothing_heavy):
    specs = [ModelSpec.parse("smollm2-135m-instruct"), ModelSpec.parse("smollm2-135m-instruct:int8")]
    registry = ModelRegistry(specs, metrics=ServerMetrics(), budget=2**30, max_seq_len=512, kv_cache_mib=32)
    plans = registry.plan_all()
    assert [p.weights for p in plans] == [{"float32": 538_060_032}, {"int8": 135_298_560, "float32": 140_544}]
    assert nothing_heavy == []
    packed = ModelRegistry([ModelSpec.parse("smollm2-135m-instruct:gguf")], metrics=ServerMetrics()).plan_all()[0]
    assert packed.weights == {"Q8_0": 30_081_024, "float32": 140_544, "Q4_1": 66_355_200}  # the GGUF's header
    assert nothing_heavy == []
    with pytest.raises(MemoryBudgetError, match="budget is 300.0 MiB"):
        ModelRegistry(specs, metrics=ServerMetrics(), budget=300 * 2**20, max_seq_len=512).plan_all()
    assert nothing_heavy == []
