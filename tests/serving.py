"""Start and stop a `kiln serve` process on loopback for the server tests."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

KEY = "sk-kiln-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(artifact, log_path: Path, *args: str):
    """Yield (url, process) of `kiln serve ARTIFACT --api-key KEY *args` once /health answers 200."""
    port = free_port()
    log = open(log_path, "w")        # a file: a pipe could fill and block
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(artifact), "--port", str(port),
                             "--api-key", KEY, *args], stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                health = httpx.get(f"{url}/health", timeout=2)
                if health.status_code == 200:
                    break
                if health.json().get("status") == "error":          # the model failed to load
                    raise RuntimeError(f"kiln serve: {health.text}\n{open(log_path).read()[-3000:]}")
            except (httpx.HTTPError, ValueError):
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited: {open(log_path).read()[-3000:]}")
            time.sleep(0.3)
        else:
            raise RuntimeError("kiln serve did not become healthy in 120 s")
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
