"""The several-model registry's eviction rules and the memory plan's unit of a request (issue 49).

- ``ModelRegistry._make_room``: to load a model that does not fit, idle models are unloaded least
  recently used first, only as many as needed; a running one never; a model that fits the budget
  *exactly* evicts nothing (the budget is "at most", not "less than").
- ``memory_plan.make_plan``: one full-context request holds whole KV blocks, so the budget must hold
  ``ceil(context / block_size)`` blocks, not ``context`` positions.

The registry's slots here are stand-ins with the fields ``_make_room`` reads (state, idle, last use,
plan bytes): no model is loaded, nothing is timed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tiny_models import tiny_config

from minillm.errors import MemoryBudgetError
from minillm.model.config import ModelConfig
from minillm.runtime.memory_plan import make_plan
from minillm.serve.metrics import ServerMetrics
from minillm.serve.models import ModelRegistry

RUNTIME = 50


class Slot:
    """What ``_make_room`` reads of a ``ModelSlot``; ``unload`` records the order of evictions."""

    def __init__(self, name: str, model_bytes: int, last_use: float | None, *, busy=False, state="loaded"):
        self.spec = SimpleNamespace(served=name)
        self.plan = SimpleNamespace(model_bytes=model_bytes)
        self.last_use, self.busy, self.state = last_use, busy, state
        self.unloaded = False

    @property
    def idle(self) -> bool:
        return self.state == "loaded" and not self.busy

    def unload(self) -> None:
        self.state, self.unloaded = "unloaded", True


def registry(budget, *slots: Slot, max_loaded=None) -> ModelRegistry:
    r = ModelRegistry([], metrics=ServerMetrics(), budget=budget, max_loaded=max_loaded)
    r.slots = {s.spec.served: s for s in slots}
    r.runtime_bytes = RUNTIME
    return r


def loaded(r: ModelRegistry) -> list[str]:
    return [name for name, s in r.slots.items() if s.state == "loaded"]


def test_eviction_is_least_recently_used_first_and_only_as_many_as_needed():
    """A last used at t=30, B at 10, C at 20 (100 bytes each), budget runtime + 300: D (200 bytes)
    needs two out: B (oldest), then C; A, the most recent, stays."""
    a, b, c = Slot("A", 100, 30.0), Slot("B", 100, 10.0), Slot("C", 100, 20.0)
    d = Slot("D", 200, None, state="unloaded")
    r = registry(RUNTIME + 300, a, b, c, d)
    assert r._make_room(d) == [("B", "memory budget"), ("C", "memory budget")]
    assert loaded(r) == ["A"]


def test_a_running_model_is_never_evicted_however_old():
    """B is the oldest but busy: C and then A go instead; with only B left over budget, D waits (None)."""
    a, b, c = Slot("A", 100, 30.0), Slot("B", 100, 10.0, busy=True), Slot("C", 100, 20.0)
    d = Slot("D", 200, None, state="unloaded")
    r = registry(RUNTIME + 300, a, b, c, d)
    assert r._make_room(d) == [("C", "memory budget"), ("A", "memory budget")]
    big = Slot("E", 300, None, state="unloaded")
    assert r._make_room(big) is None and loaded(r) == ["B"]


def test_a_model_that_fits_the_budget_exactly_evicts_nothing():
    a, d = Slot("A", 100, 10.0), Slot("D", 200, None, state="unloaded")
    r = registry(RUNTIME + 100 + 200, a, d)  # runtime + A + D == the budget: it fits
    assert r._make_room(d) == [] and loaded(r) == ["A"]
    r = registry(RUNTIME + 100 + 200 - 1, a, d)  # one byte less: A goes
    assert r._make_room(d) == [("A", "memory budget")] and loaded(r) == []


def test_max_loaded_counts_the_loaded_models():
    a, b, d = Slot("A", 1, 20.0), Slot("B", 1, 10.0), Slot("D", 1, None, state="unloaded")
    r = registry(None, a, b, d, max_loaded=3)
    assert r._make_room(d) == []  # two loaded, room for a third
    r = registry(None, a, b, d, max_loaded=2)
    assert r._make_room(d) == [("B", "max loaded models")] and loaded(r) == ["A"]


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(108))  # context 32, one layer, one KV head of 4: 32 B per position


def test_one_full_context_request_is_planned_as_whole_blocks(config):
    """Context 20 in blocks of 16 takes 2 blocks (32 positions), not 20 positions' bytes: a budget
    one byte short of 2 blocks is refused, though it holds 20 positions (and even one more block's worth
    minus a byte)."""
    per_token = config.kv_bytes_per_token()
    per_block = 16 * per_token
    free = make_plan(config, model="tiny", context=20, block_size=16, kv_cache_mib=1)
    fixed = free.weights_total + free.activations  # tokenizer and runtime 0 here
    plan = make_plan(config, model="tiny", context=20, block_size=16, budget=fixed + 2 * per_block)
    assert (plan.kv_pool, plan.kv_tokens) == (2 * per_block, 32)
    assert fixed + 20 * per_token < fixed + 2 * per_block - 1  # 20 positions would fit the short budget
    with pytest.raises(MemoryBudgetError, match=r"for one full-context request \(20 positions\)"):
        make_plan(config, model="tiny", context=20, block_size=16, budget=fixed + 2 * per_block - 1)
