"""The replicas' gauges (kiln.serve.metrics.EngineGauges), gathered where the ingress's /metrics reads
them: a small named Ray actor that each replica writes to every `PERIOD` seconds for as long as it
runs. An entry older than `STALE` seconds is a replica that has stopped: it no longer counts. Times
are the board's clock (`now`), so a reader can ask for what was written after a moment of its own."""
from __future__ import annotations

import time

import ray

PERIOD = 0.5
STALE = 5.0
NAMESPACE = "kiln"


@ray.remote(num_cpus=0)
class Board:
    def __init__(self):
        self.entries: dict[str, tuple[str, object, float]] = {}

    def put(self, replica: str, role: str, gauges) -> None:
        self.entries[replica] = (role, gauges, time.monotonic())

    def remove(self, replica: str) -> None:
        self.entries.pop(replica, None)

    def now(self) -> float:
        return time.monotonic()

    def read(self, since: float | None = None) -> dict[str, tuple[str, object]]:
        """replica id -> (role, gauges), for the replicas heard from within STALE seconds (and after
        `since`, a time of `now`'s, where given)."""
        now = time.monotonic()
        return {r: (role, g) for r, (role, g, at) in self.entries.items()
                if now - at < STALE and (since is None or at > since)}


def board(app_name: str):
    """The application's board (made by the first one to ask; it outlives any one replica)."""
    return Board.options(name=f"kiln-board-{app_name}", namespace=NAMESPACE, get_if_exists=True,
                         lifetime="detached").remote()
