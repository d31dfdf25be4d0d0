"""Request routers for kiln's replicas, through Ray Serve's RequestRouter interface.

PrefixAwareRouter sends a request to the replica most likely to hold its prompt's leading KV pages
in its prefix cache, unless that replica's queue is longer than the shortest by more than
`imbalance` requests; a prompt no replica has seen goes to the shortest queue. It remembers, per
replica, the chained digests (kiln.runtime.kv_pool.page_digest, the engine's own page keys) of the
leading full pages of the prompts it routed there, least recently used first out past `capacity`
pages: a replica's prefix cache evicts in the same order, so what the router remembers is what the
replica most likely still has. The state lives in the router, in the process that holds the
handle (the ingress); several ingress replicas each learn on their own.

RoundRobinRouter takes the replicas in turn: the baseline the prefix-aware one is measured against.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kiln.runtime.kv_pool import page_digest


class PrefixIndex:
    """Which leading pages each replica was last sent, bounded per replica."""

    def __init__(self, page_size: int, capacity: int = 8192, lead_pages: int = 64):
        self.page_size, self.capacity, self.lead_pages = page_size, capacity, lead_pages
        self.pages: dict[object, OrderedDict[bytes, None]] = {}

    def digests(self, prompt_ids: list[int]) -> list[bytes]:
        """The chained digests of the prompt's leading full pages (at most lead_pages)."""
        p, out = self.page_size, []
        for i in range(min(len(prompt_ids) // p, self.lead_pages)):
            out.append(page_digest(out[-1] if out else None, prompt_ids[i * p:(i + 1) * p]))
        return out

    def match(self, replica, digests: list[bytes]) -> int:
        """How many of the leading pages the replica was sent (a chain: the first miss ends it)."""
        held = self.pages.get(replica, {})
        return next((i for i, d in enumerate(digests) if d not in held), len(digests))

    def record(self, replica, digests: list[bytes]) -> None:
        held = self.pages.setdefault(replica, OrderedDict())
        for d in digests:
            held[d] = None
            held.move_to_end(d)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, replica) -> None:
        self.pages.pop(replica, None)

    def size(self, replica) -> int:
        return len(self.pages.get(replica, ()))


def rank(index: PrefixIndex, queues: dict, digests: list[bytes], imbalance: int) -> list:
    """The replicas (keys of `queues`, each replica's queue length) best first: the longest prefix
    match among those within `imbalance` of the shortest queue, then by queue length, then by how
    little the router has sent there (new prefixes spread out)."""
    shortest = min(queues.values())
    matched = {r: index.match(r, digests) for r in queues}

    def key(r):
        eligible = queues[r] - shortest <= imbalance
        return (-(matched[r] if eligible else 0), queues[r], index.size(r))
    return sorted(queues, key=key)


def prompt_ids_of(pending: PendingRequest | None) -> list[int]:
    """The first prompt's token ids of a kiln replica call (kiln.serve.cluster.replica: a job dict)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return []
    requests = pending.args[0].get("requests") or [{}]
    return list(requests[0].get("prompt_ids") or ())


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, page_size: int = 16, imbalance: int = 4, capacity: int = 8192):
        self.index = PrefixIndex(page_size, capacity)
        self.imbalance = imbalance
        self._digests: OrderedDict[int, list[bytes]] = OrderedDict()   # id(pending request) -> digests, until routed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        queues, unknown = {}, []
        for r in candidate_replicas:
            length = self.replica_queue_len_cache.get(r.replica_id)
            if length is None:
                unknown.append(r)
            else:
                queues[r.replica_id] = length
        if unknown:
            for r, length in await self._probe_queue_lens(unknown, 0):
                if length is not None:
                    queues[r.replica_id] = length
        if not queues:
            return [candidate_replicas]
        digests = self.index.digests(prompt_ids_of(pending_request))
        if pending_request is not None:
            self._digests[id(pending_request)] = digests
            while len(self._digests) > 4096:          # requests cancelled before they were routed
                self._digests.popitem(last=False)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[r]] for r in rank(self.index, queues, digests, self.imbalance)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        digests = self._digests.pop(id(pending_request), None)
        if digests:
            self.index.record(replica_id, digests)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **_):
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return [[]]
        first = next(self._turn) % len(ordered)
        return [[r] for r in ordered[first:] + ordered[:first]]


ROUTERS = {"prefix": PrefixAwareRouter, "round-robin": RoundRobinRouter}
