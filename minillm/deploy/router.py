"""Prefix-aware routing: send a request to the replica holding the most of its prompt's prefix blocks.

    the request's body        -> its prompt's ids (the model's tokenizer and chat template, as the
                                 worker renders them) -> the block hash chain of the paged pool
                                 (``model.paged_kv_cache.block_hashes``, under the replica's identity)
    each replica's stats      -> the hashes its pool holds (``replica.record_routing_stats``), plus
                                 the ones this router sent it since (its stats lag a period behind)
    choose                    -> the replica with the longest run of held blocks from the start;
                                 when replicas are imbalanced (their queues differ by more than
                                 ``imbalanced_threshold``) or nothing matches: the least loaded

Ray's default router picks the less loaded of two random replicas (power of two choices); it never
looks at the prompt. Ray Serve LLM's ``PrefixCacheAffinityRouter`` keeps a tree of prompt *text*;
this one reads the pool's own block hashes, so a match is a block the replica really holds.
"""

from __future__ import annotations

import json
from collections import defaultdict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from minillm.model.paged_kv_cache import block_hashes


class PrefixRouter(RequestRouter):
    """A Ray Serve ``RequestRouter`` over minillm replicas (``request_router_kwargs``: ``model``,
    ``imbalanced_threshold`` in queued requests)."""

    def initialize_state(self, model: str = "smollm2-135m-instruct", imbalanced_threshold: int = 8):
        from minillm.sources.plan_files import plan_folder
        from minillm.text.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_folder(plan_folder(model))
        self.imbalanced_threshold = imbalanced_threshold
        self.sent: dict = defaultdict(set)  # replica id -> hashes routed to it since its stats came

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas, best first: the one holding most of the prompt's prefix (when loads are
        balanced), then the rest by load. A request whose body has no prompt: least loaded first."""
        loads = {}
        for replica, queue_len in await self._probe_queue_lens(candidate_replicas, 0):
            loads[replica.replica_id] = queue_len if queue_len is not None else 10**6
        by_load = sorted(candidate_replicas, key=lambda r: loads.get(r.replica_id, 10**6))
        ids = prompt_ids(self.tokenizer, pending_request)
        if ids is None or not by_load:
            return [by_load]
        spread = max(loads.values(), default=0) - min(loads.values(), default=0)
        held = {r.replica_id: self.matched(r, ids) for r in candidate_replicas}
        best = max(held.values(), default=0)
        if spread > self.imbalanced_threshold or best == 0:
            return [by_load]
        first = [r for r in by_load if held[r.replica_id] == best]
        return [first, [r for r in by_load if r not in first]]

    def matched(self, replica: RunningReplica, ids: list[int]) -> int:
        """How many of ``ids``' leading full blocks ``replica`` holds (its stats, or sent to it since)."""
        stats = replica.routing_stats or {}
        if "identity" not in stats:
            return 0
        hashes = block_hashes(ids, stats["block_size"], identity=bytes.fromhex(stats["identity"]))
        held = set(stats["blocks"]) | self.sent[replica.replica_id]
        n = 0
        for h in hashes:
            if h.hex() not in held:
                break
            n += 1
        return n

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Remember that ``replica_id`` will hold this prompt's blocks (before its stats say so)."""
        ids = prompt_ids(self.tokenizer, pending_request)
        replica = self._replicas.get(replica_id) if hasattr(self, "_replicas") else None
        stats = (replica.routing_stats if replica is not None else None) or {}
        if ids is None or "identity" not in stats:
            return
        hashes = block_hashes(ids, stats["block_size"], identity=bytes.fromhex(stats["identity"]))
        self.sent[replica_id].update(h.hex() for h in hashes)


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
