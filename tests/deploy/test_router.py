"""The prefix router's memory of what it sent each replica (minillm/deploy/router.py), in this process:
no Ray instance is started; the replicas are stand-ins with an id and routing stats, as Ray's
``RunningReplica`` gives them to ``choose_replicas``.

- a prompt routed to a replica is matched there afterwards, block for block, from its first block;
- the memory is bounded: ``remembered_pools`` x the replica's pool blocks (its stats' ``num_blocks``),
  or ``REMEMBERED_WITHOUT_STATS`` before stats come; the least recently sent prompts go first, and of a
  prompt its deepest blocks first, so what is kept still matches from the start;
- what was sent to a replica Ray no longer runs (rolled, scaled down) is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments import MODEL
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from minillm.deploy.router import PrefixRouter
from minillm.model.paged_kv_cache import block_hashes

BLOCK = 4


@dataclass
class Replica:
    """What the router reads of a Ray ``RunningReplica``."""

    replica_id: str
    routing_stats: dict | None = None


def router(**kwargs) -> PrefixRouter:
    r = PrefixRouter(
        deployment_id=DeploymentID(name="minillm", app_name="test"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    r.initialize_state(model=MODEL, block_size=BLOCK, **kwargs)
    return r


def prompt(k: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of ids, distinct for each ``k``."""
    return [1000 * (k + 1) + i for i in range(blocks * BLOCK)]


def test_a_routed_prompt_is_matched_on_its_replica_from_the_first_block():
    r, a, b = router(), Replica("a"), Replica("b")
    r.remember(a, block_hashes(prompt(0, 3), BLOCK))
    assert r.matched(a, prompt(0, 3)) == 3 and r.matched(b, prompt(0, 3)) == 0
    longer = prompt(0, 3) + prompt(1, 2)  # the same three blocks, then two of its own
    assert r.matched(a, longer) == 3 and r.holding(a) == 3 and r.holding(b) == 0
    assert r.matched(a, prompt(0, 3)[1:]) == 0  # shifted by one id: no block starts alike


def test_the_memory_is_remembered_pools_times_the_replicas_pool_least_recent_first():
    r = router(remembered_pools=2)
    a = Replica("a", {"blocks": [], "block_size": BLOCK, "num_blocks": 6})  # remembers 2 x 6 = 12 blocks
    for k in range(4):  # four prompts of 4 blocks: 16 blocks sent
        r.remember(a, block_hashes(prompt(k, 4), BLOCK))
    assert r.holding(a) == 12
    assert [r.matched(a, prompt(k, 4)) for k in range(4)] == [0, 4, 4, 4]  # the oldest prompt forgotten
    r.remember(a, block_hashes(prompt(1, 4), BLOCK))  # sent again: now the most recent
    r.remember(a, block_hashes(prompt(4, 2), BLOCK))  # 2 blocks more: prompt 2 (now the oldest) loses 2
    assert [r.matched(a, prompt(k, 4)) for k in range(5)] == [0, 4, 2, 4, 2]  # its first two blocks kept


def test_before_stats_come_the_memory_has_its_stated_bound():
    r, a = router(), Replica("a")
    many = PrefixRouter.REMEMBERED_WITHOUT_STATS + 3 * BLOCK
    r.remember(a, block_hashes(list(range(many * BLOCK)), BLOCK))
    assert r.holding(a) == PrefixRouter.REMEMBERED_WITHOUT_STATS


def test_what_was_sent_to_a_replica_that_left_is_forgotten():
    r, a, b = router(), Replica("a"), Replica("b")
    r.remember(a, block_hashes(prompt(0, 2), BLOCK))
    r.remember(b, block_hashes(prompt(1, 2), BLOCK))
    r.forget_all_but({"b"})  # what update_replicas does with Ray's new set of running replicas
    assert set(r.sent) == {"b"} and r.matched(a, prompt(0, 2)) == 0 and r.matched(b, prompt(1, 2)) == 2
