"""Looking at and acting on a running kiln application on Ray Serve: its replicas, their gauges, and
killing one (what the resilience tests and bench/cluster.py do to it)."""
from __future__ import annotations

import time

import ray
from ray import serve

from .board import board


def running_replicas(app: str, deployment: str) -> int:
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return status.deployments[deployment].replica_states.get("RUNNING", 0)


def replica_actors(app: str, deployment: str) -> list[str]:
    """The Ray actor names of the deployment's replicas (namespace "serve")."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill_replica(app: str, deployment: str, index: int = 0) -> str:
    """Kill one replica's actor at once (as a machine that fails); Ray Serve starts another."""
    name = replica_actors(app, deployment)[index]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


def replica_gauges(app: str) -> dict:
    """replica id -> (role, EngineGauges), for the replicas heard from lately."""
    return ray.get(board(app).read.remote())


def wait_for(predicate, timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()
