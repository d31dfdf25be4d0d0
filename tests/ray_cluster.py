"""One local Ray cluster per pytest process (per xdist worker), shared by every test that runs on Ray.

Starting a cluster costs ~10 s and Serve's controller and proxy a few more, so the first test that asks
starts them and they stop when the session ends. Serve's proxy is one per cluster, on one port: every
application a test deploys is at "/" of `ray_serve`'s URL, and a test that deploys one removes the
others (kiln.testing.cluster_ops.deploy); a test that needs an application again deploys it again.
`kiln serve --replicas --ray-address` attaches to the cluster at `ray_cluster`'s address.
"""
from __future__ import annotations

import pytest

from serving import free_port


@pytest.fixture(scope="session")
def ray_cluster():
    """The address of this process's Ray cluster (its GCS), started on first use."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_serve(ray_cluster):
    """The URL of Ray Serve's proxy on this process's cluster."""
    from ray import serve
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
