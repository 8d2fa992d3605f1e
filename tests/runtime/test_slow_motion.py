"""Slow motion in the scheduler (minillm/runtime/scheduler.py, ``step_delay_s``): a request sits
out the steps after each of its own, keeping its blocks, and ``Scheduler.held`` lists it only on
the steps it sat out (the live page hatches exactly those; issue 41: it used to list the request on
the very step that fed it). On the tiny seeded Llama (tests/support/tiny_models.py), by states,
never by a clock: a delay of an hour holds the request until the test lets it go (``hold_until = 0``).
"""

from __future__ import annotations

import pytest
from tiny_models import tiny_word_model

import minillm
from minillm.model.paged_kv_cache import KVCachePool
from minillm.runtime.scheduler import BatchRequest, Scheduler

HOUR = 3600.0
NO_EOS = minillm.SamplingParams(temperature=0.0, logit_bias={1: -100, 106: -100})  # every request runs to its max


@pytest.fixture()
def tiny(tmp_path):
    return tiny_word_model(tmp_path)


def test_a_slow_request_is_held_only_on_the_steps_it_sits_out(tiny):
    c = tiny.config
    pool = KVCachePool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_blocks=16, block_size=4)
    scheduler = Scheduler(tiny, pool, max_batched_tokens=64, max_num_seqs=4)

    def request(index, prompt, new, **slow):
        return BatchRequest(tiny, prompt, NO_EOS, pool=pool, index=index, max_new_tokens=new, **slow)

    slow = request(0, "AB C DEF G", 3, step_delay_s=HOUR)  # <bos> + 4 words: 5 prompt tokens
    plain = request(1, "HI J KL", 4)
    scheduler.add(slow)
    scheduler.add(plain)
    scheduler.step()  # both prefill: the slow one was fed, so it is not held on this step
    assert scheduler.held == [] and slow.seq.length == 5 and len(slow.new_ids) == 1
    blocks = list(slow.seq.block_table)
    for _ in range(2):  # the plain one decodes; the slow one sits out, keeping its blocks
        scheduler.step()
        assert scheduler.held == [slow] and slow.seq.length == 5 and slow.seq.block_table == blocks
    assert len(plain.new_ids) == 3 and len(slow.new_ids) == 1
    slow.hold_until = 0.0  # its hour is up: fed again, and not held on the step that fed it
    scheduler.step()
    assert scheduler.held == [] and slow.seq.length == 6 and len(slow.new_ids) == 2
    assert plain.result is not None  # the plain one's 4th token ended it in that same step
    assert scheduler.seconds_until_ready() > HOUR - 60  # alone and sitting out: the worker may wait
    slow.hold_until = 0.0
    scheduler.step()
    assert scheduler.held == [] and slow.result is not None and len(slow.new_ids) == 3
