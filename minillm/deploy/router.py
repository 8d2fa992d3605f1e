"""Prefix-aware routing: send a request to the replica holding the most of its prompt's prefix blocks.

    the request's body        -> its prompt's ids (the model's tokenizer and chat template, as the
                                 worker renders them) -> the block hash chain of the paged pool
                                 (``model.paged_kv_cache.block_hashes``, under the replica's identity)
    each replica's stats      -> the hashes its pool holds (``replica.record_routing_stats``), plus
                                 the prompts this router sent it (its stats lag a period behind;
                                 kept after the pool evicts them, so a prefix sticks to its
                                 replica, which computes it again): the most recent
                                 ``remembered_pools`` x its pool's blocks, forgotten oldest first,
                                 and all of them when the replica leaves (rolled, scaled down)
    choose                    -> the replica with the longest run of held blocks from the start;
                                 when replicas are imbalanced (their queues differ by more than
                                 ``imbalanced_threshold``) or nothing matches: the least loaded
    a request naming a replica  -> that replica (header ``x-minillm-replica``: the live page's
                                 ``/ui?replica=ID`` follows one replica's events)

Ray's default router picks the less loaded of two random replicas (power of two choices); it never
looks at the prompt. Ray Serve LLM's ``PrefixCacheAffinityRouter`` keeps a tree of prompt *text*;
this one reads the pool's own block hashes, so a match is a block the replica really holds.
"""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from minillm.model.paged_kv_cache import block_hashes


class PrefixRouter(RequestRouter):
    """A Ray Serve ``RequestRouter`` over minillm replicas (``request_router_kwargs``: ``model``,
    ``imbalanced_threshold`` in queued requests, ``block_size``, ``remembered_pools``: how many of a
    replica's pools of block hashes the router remembers having sent it, the most recent first)."""

    #: blocks remembered for a replica whose stats have not come yet (no pool size known)
    REMEMBERED_WITHOUT_STATS = 4096

    def initialize_state(
        self,
        model: str = "smollm2-135m-instruct",
        imbalanced_threshold: int = 8,
        block_size: int = 16,
        remembered_pools: int = 4,
    ):
        from minillm.sources.plan_files import plan_folder
        from minillm.text.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_folder(plan_folder(model))
        self.imbalanced_threshold, self.block_size = imbalanced_threshold, block_size
        self.remembered_pools = remembered_pools
        # replica id -> the hashes routed to it, least recently sent first (bounded: remember())
        self.sent: dict = defaultdict(OrderedDict)

    def update_replicas(self, replicas: list[RunningReplica]):
        """Ray's new set of running replicas: forget what was sent to the ones gone."""
        super().update_replicas(replicas)
        self.forget_all_but({r.replica_id for r in replicas})

    def forget_all_but(self, running: set) -> None:
        """Drop the hashes sent to replicas not in ``running`` (replica ids): their pools are gone."""
        for gone in [replica_id for replica_id in self.sent if replica_id not in running]:
            del self.sent[gone]

    def remember(self, replica: RunningReplica, hashes: list[bytes]) -> None:
        """``hashes`` were just sent to ``replica``: the most recent, kept up to ``remembered_pools`` x
        the blocks of its pool (its stats' ``num_blocks``), the least recently sent forgotten first, and
        of one prompt its deepest blocks first (a match runs from the first block: a tree loses leaves)."""
        sent = self.sent[replica.replica_id]
        for h in reversed(hashes):  # a prompt's first block the most recent: its deepest blocks go first
            sent[h.hex()] = None
            sent.move_to_end(h.hex())
        pool_blocks = (replica.routing_stats or {}).get("num_blocks")
        limit = self.remembered_pools * pool_blocks if pool_blocks else self.REMEMBERED_WITHOUT_STATS
        while len(sent) > limit:
            sent.popitem(last=False)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas, best first: the one holding most of the prompt's prefix (when loads are
        balanced), else the least loaded (between equals, the one holding fewest blocks, so a new
        prefix goes where there is room); the rest after it. A request whose body has no prompt:
        least loaded first. The first choice is remembered as holding the prompt's blocks."""
        pinned = [r for r in candidate_replicas if r.replica_id.unique_id == asked_replica(pending_request)]
        if pinned:  # a client following one replica (the live page's /ui?replica=ID)
            return [pinned]
        loads = {}
        for replica, queue_len in await self._probe_queue_lens(candidate_replicas, 0):
            loads[replica.replica_id] = queue_len if queue_len is not None else 10**6
        by_load = sorted(candidate_replicas, key=lambda r: (loads.get(r.replica_id, 10**6), self.holding(r)))
        ids = prompt_ids(self.tokenizer, pending_request)
        if ids is None or not by_load:
            return [by_load]
        spread = max(loads.values(), default=0) - min(loads.values(), default=0)
        held = {r.replica_id: self.matched(r, ids) for r in candidate_replicas}
        best = max(held.values(), default=0)
        if spread <= self.imbalanced_threshold and best > 0:
            by_load.sort(key=lambda r: held[r.replica_id] != best)  # stable: by load among the best
        self.remember(by_load[0], block_hashes(ids, self.block_size))
        return [by_load[:1], by_load[1:]]

    def matched(self, replica: RunningReplica, ids: list[int]) -> int:
        """How many of ``ids``' leading full blocks ``replica`` holds: in its pool (its stats, hashed
        under its identity) or sent to it by this router, as far as it remembers (:meth:`remember`;
        hashed under no identity)."""
        stats = replica.routing_stats or {}
        size = stats.get("block_size", self.block_size)
        pooled = set(stats.get("blocks", ()))
        ours = block_hashes(ids, size, identity=bytes.fromhex(stats["identity"])) if "identity" in stats else []
        sent = block_hashes(ids, size)
        n = 0
        while n < len(sent) and (
            (n < len(ours) and ours[n].hex() in pooled) or sent[n].hex() in self.sent[replica.replica_id]
        ):
            n += 1
        return n

    def holding(self, replica: RunningReplica) -> int:
        """How many block hashes ``replica`` holds (its stats, and what this router remembers sending it)."""
        stats = replica.routing_stats or {}
        return len(set(stats.get("blocks", ())) | self.sent[replica.replica_id].keys())


def asked_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica id a relayed request names in its ``x-minillm-replica`` header, or None."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], dict):
        return None
    headers = dict(pending_request.args[0].get("headers") or [])
    value = headers.get(b"x-minillm-replica")
    return value.decode("latin-1") if value else None


def prompt_ids(tokenizer, pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt's token ids of a relayed request (``args``: the ASGI scope and the JSON body), as
    the worker tokenizes them: the chat template over ``messages``, or ``prompt`` with special
    tokens; None when the request carries no readable prompt."""
    if pending_request is None or len(pending_request.args) < 2 or not isinstance(pending_request.args[1], bytes):
        return None
    try:
        body = json.loads(pending_request.args[1])
        if isinstance(body.get("messages"), list):
            text = tokenizer.apply_chat_template(body["messages"])
            return list(tokenizer.encode(text, add_special_tokens=False))
        if isinstance(body.get("prompt"), str):
            return list(tokenizer.encode(body["prompt"], add_special_tokens=True))
    except Exception:  # noqa: BLE001 - a body the app will refuse (400) is routed by load alone
        return None
    return None
