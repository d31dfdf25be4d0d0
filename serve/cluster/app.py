"""The Ray Serve application: kiln engine replicas behind one OpenAI ingress.

    ingress (FastAPI: kiln.serve.app's routes)  ──prefix-aware router──▶  engine replicas × N
                                                ──(disaggregated)──────▶  prefill replicas × P
                                                                          then decode replicas × N

`build_app(config, cluster)` makes it; `kiln serve ART --replicas N` runs it on a local Ray cluster or
on one at `--ray-address`; `app_builder` is the same for a user's own Ray Serve config file:

    applications:
      - name: kiln
        route_prefix: /
        import_path: kiln.serve.cluster.app:app_builder
        args: {artifact: /models/llama-cuda, replicas: 2, max_replicas: 8, routing: prefix}

Each replica takes `num_cpus` (its kernel threads) or one GPU through ray_actor_options; with
`max_replicas`, Ray Serve scales the engine deployment on ongoing requests per replica. Ray Serve
health-checks every replica (KilnReplica.check_health) and starts a new one for one that died.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from dataclasses import dataclass

from ray import serve
from ray.serve.config import RequestRouterConfig

from kiln.artifact import read_manifest
from kiln.errors import KilnError
from kiln.runtime.config import EngineConfig
from kiln.runtime.tokenizer import Tokenizer
from kiln.serve.app import ServerConfig, create_app

from .board import board
from .remote import RemoteEngine, RemoteLLM
from .replica import KilnReplica
from .router import ROUTERS
from .transport import TRANSPORTS


@dataclass
class ClusterConfig:
    replicas: int = 2                     # engine replicas (the decode ones, when disaggregated)
    max_replicas: int | None = None       # autoscale from `replicas` up to this on ongoing requests
    target_ongoing_requests: float = 8.0  # what autoscaling aims for per replica
    prefill_replicas: int = 0             # > 0: prefill/decode disaggregation with this many prefill replicas
    routing: str = "prefix"               # router.py ROUTERS
    transport: str = "ray-object-store"   # transport.py TRANSPORTS
    num_cpus: float | None = None         # per replica (None: the engine's threads, else 1)
    num_gpus: float | None = None         # per replica (None: 1 for a GPU artifact, else 0)
    app_name: str = "kiln"

    def check(self) -> None:
        if self.replicas < 1 or self.prefill_replicas < 0:
            raise KilnError("--replicas must be at least 1 (and --prefill-replicas at least 0)")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise KilnError(f"--max-replicas {self.max_replicas} is below --replicas {self.replicas}")
        if self.routing not in ROUTERS:
            raise KilnError(f"unknown routing {self.routing!r} (known: {', '.join(ROUTERS)})")
        if self.transport not in TRANSPORTS:
            raise KilnError(f"unknown KV transport {self.transport!r} (known: {', '.join(TRANSPORTS)})")


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class KilnIngress:
    """The OpenAI routes, their engine the replicas (remote.py)."""

    async def __init__(self, config: ServerConfig, engines, prefill=None):
        self.config, self.engines, self.prefill = config, engines, prefill
        self.info = await engines.describe.remote()
        self.board = board(serve.get_replica_context().app_name)

    def __serve_build_asgi_app__(self):
        def opener(config: ServerConfig):
            llm = RemoteLLM(self.info, Tokenizer(config.artifact))
            split = "" if self.prefill is None else "prefill and decode on separate replicas; "
            return llm, RemoteEngine(llm, self.engines, self.board, self.prefill), \
                f"{split}each replica: {self.info['description']}"
        return create_app(self.config, load_now=True, opener=opener)


def build_app(config: ServerConfig, cluster: ClusterConfig):
    """The application (for serve.run)."""
    cluster.check()
    manifest = read_manifest(config.artifact, verify=False)
    gpu = manifest.target.device != "cpu"
    engine = config.engine
    actor = {"num_cpus": cluster.num_cpus if cluster.num_cpus is not None else (engine.threads or 1),
             "num_gpus": cluster.num_gpus if cluster.num_gpus is not None else (1 if gpu else 0)}
    kwargs = {"page_size": manifest.kv.page_size} if cluster.routing == "prefix" else {}
    router = RequestRouterConfig(request_router_class=ROUTERS[cluster.routing], request_router_kwargs=kwargs)

    def engines(name: str, count: int, role: str, autoscale: bool):
        options = dict(name=name, ray_actor_options=actor, request_router_config=router,
                       max_ongoing_requests=2 * engine.max_num_seqs, max_queued_requests=engine.max_waiting,
                       health_check_period_s=2.0, graceful_shutdown_timeout_s=5.0)
        if autoscale and cluster.max_replicas is not None:
            options["autoscaling_config"] = {"min_replicas": count, "max_replicas": cluster.max_replicas,
                                             "initial_replicas": count,
                                             "target_ongoing_requests": cluster.target_ongoing_requests}
        else:
            options["num_replicas"] = count
        return serve.deployment(KilnReplica).options(**options).bind(config, role, cluster.transport)

    # the ingress holds every request in flight: the engines' batches and queues, and what waits for them
    most = (cluster.max_replicas or cluster.replicas) * 2 * engine.max_num_seqs + engine.max_waiting
    ingress = KilnIngress.options(max_ongoing_requests=most)
    if cluster.prefill_replicas:
        prefill = engines("prefill", cluster.prefill_replicas, "prefill", autoscale=False)
        return ingress.bind(config, engines("decode", cluster.replicas, "decode", autoscale=True), prefill)
    return ingress.bind(config, engines("engine", cluster.replicas, "engine", autoscale=True))


def app_builder(args: dict):
    """For a Ray Serve config file's import_path: `args` are ClusterConfig's fields and ServerConfig's
    (the engine's among them, runtime/config.py), flat."""
    cluster = {f.name for f in dataclasses.fields(ClusterConfig)}
    known = cluster | {f.name for config in (ServerConfig, EngineConfig) for f in dataclasses.fields(config)}
    unknown = set(args) - known
    if unknown:
        raise KilnError(f"unknown kiln application arguments: {', '.join(sorted(unknown))}")
    return build_app(ServerConfig.of(**{k: v for k, v in args.items() if k not in cluster}),
                     ClusterConfig(**{k: v for k, v in args.items() if k in cluster}))


class _Stopped(Exception):
    """SIGINT or SIGTERM while the application starts."""


def run(config: ServerConfig, cluster: ClusterConfig, host: str = "127.0.0.1", port: int = 8000,
        ray_address: str | None = None) -> None:
    """`kiln serve --replicas`: the application on Ray (a local cluster, or the one at ray_address),
    until SIGINT or SIGTERM; then it is deleted (and a local cluster stopped)."""
    import ray
    from kiln.serve.server import bind
    cluster.check()
    bind(host, port).close()                     # a busy port is one line, before Ray starts
    app = build_app(config, cluster)
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    stop, starting = threading.Event(), [True]

    def on_signal(*_):
        stop.set()
        if starting[0]:                          # serve.run is waiting for the replicas: stop waiting
            raise _Stopped()
    # (after ray.init, whose handlers end the process at once, and before anything can be left running)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=cluster.app_name, route_prefix="/")
        starting[0] = False
        where = f"Ray cluster at {ray_address}" if ray_address else "a local Ray cluster"
        split = f"{cluster.prefill_replicas} prefill + " if cluster.prefill_replicas else ""
        print(f"kiln serve: {config.model_name} on {where}: {split}{cluster.replicas} replicas, "
              f"{cluster.routing} routing; http://{host}:{port}", file=sys.stderr, flush=True)
        stop.wait()
    except _Stopped:
        pass
    finally:
        starting[0] = False
        serve.delete(cluster.app_name)
        if not ray_address:
            serve.shutdown()
        ray.shutdown()
