"""Deploying, looking at and acting on a kiln application on Ray Serve: its replicas, their gauges,
and killing one (what the resilience tests and bench/cluster.py do to it)."""
from __future__ import annotations

import time

import ray
from ray import serve

from kiln.serve.cluster.app import ClusterConfig, build_app
from kiln.serve.cluster.board import board


def deploy(config, cluster: ClusterConfig) -> None:
    """The application (named cluster.app_name) at "/", in place of any other, once its replicas run."""
    remove_apps()
    serve.run(build_app(config, cluster), name=cluster.app_name, route_prefix="/")


def remove_apps() -> None:
    """Delete every application on the cluster, once their replicas have stopped (Serve goes on)."""
    for app in serve.status().applications:
        serve.delete(app)


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


def replica_gauges(app: str, since: float | None = None) -> dict:
    """replica id -> (role, EngineGauges), for the replicas heard from lately (after `since`, a
    board_time, where given)."""
    return ray.get(board(app).read.remote(since))


def board_time(app: str) -> float:
    """Now, on the board's clock: gauges written after it were taken after this moment."""
    return ray.get(board(app).now.remote())


def settled_gauges(app: str, replicas: int, timeout: float = 15.0) -> dict:
    """Each replica's gauges as written after this call began, once every one of the `replicas` has
    written them with no KV page in use (a load that has just ended has let go of its pages)."""
    since, found = board_time(app), {}

    def settled() -> bool:
        found.update(replica_gauges(app, since))
        return len(found) >= replicas and not any(g.kv_pages_used for _, g in found.values())
    if not wait_for(settled, timeout):
        raise TimeoutError(f"the replicas' gauges did not settle in {timeout} s: {found}")
    return found


def wait_for(predicate, timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()
