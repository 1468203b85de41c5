"""Ray Serve's request router for the engine replicas: each request to the replica with the fewest
requests this router has in flight on it.

Ray's default router (power of two choices) compares queue lengths it probes or caches; during a burst
those are a moment old and, with a busy engine slow to answer a probe, one replica took 34 of 49
requests and the other 15 in a measured run. An engine replica's load is its number of requests (each
holds one batch slot until it ends), which the router knows exactly for the requests it sent: it counts
them when routed and when completed, and breaks ties in turn, so a burst is dealt out evenly.
"""

from __future__ import annotations

from collections import Counter
from itertools import count
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    """Routes each request to the replica with the fewest of this router's requests in flight."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.in_flight: Counter[ReplicaID] = Counter()
        self.turn = count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """One rank of one replica: the least loaded, ties taken in turn."""
        if not candidate_replicas:
            return []
        fewest = min(self.in_flight[r.replica_id] for r in candidate_replicas)
        tied = sorted((r for r in candidate_replicas if self.in_flight[r.replica_id] == fewest), key=_order)
        return [[tied[next(self.turn) % len(tied)]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.in_flight[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)


def _order(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id
