"""`kiln serve` starting and stopping as a supervisor sees it: bad options and a busy port are one line
and exit 2 before anything loads, an artifact that fails to load stops the server with the line
`kiln run` prints, and SIGTERM or Ctrl-C drains (503 on /health and on new requests, the listener
still open, running streams finished) and then exits 0."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from serving import free_port

pytestmark = pytest.mark.build        # runs a compiled artifact

KILN = [sys.executable, "-m", "kiln.cli"]


@pytest.fixture(scope="module")
def artifact(llama_cpu):
    return llama_cpu[0]


def serve(artifact, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([*KILN, "serve", str(artifact), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.parametrize("option,value", [("--max-num-seqs", 0), ("--port", 99999), ("--port", -1),
                                          ("--max-batched-tokens", 0), ("--max-waiting", 0),
                                          ("--drain-timeout", -1), ("--kv-memory", "0"), ("--kv-memory", "1.5"),
                                          ("--kv-memory", "lots")])
def test_a_bad_number_is_refused_before_anything_loads(artifact, option, value):
    proc = subprocess.run([*KILN, "serve", str(artifact), option, str(value)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"Invalid value for '{option}'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "ready" not in proc.stderr and "Uvicorn" not in proc.stderr


def test_a_busy_port_is_one_line_and_exit_2(artifact):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([*KILN, "serve", str(artifact), "--port", str(port)], capture_output=True, text=True,
                              timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"kiln: error: cannot listen on 127.0.0.1:{port}: "
                                                "Address already in use"], proc.stderr


def test_an_artifact_that_fails_to_load_stops_the_server_with_runs_line(artifact, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    weights = broken / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    ran = subprocess.run([*KILN, "run", str(broken), "--prompt", "x"], capture_output=True, text=True, timeout=120)
    proc = serve(broken, "--port", free_port())
    out, _ = proc.communicate(timeout=120)
    assert ran.returncode == 2 and proc.returncode == 2, out
    line = ran.stderr.strip().splitlines()[-1]
    assert line.startswith("kiln: error:") and "checksum" in line
    assert out.strip().splitlines()[-1] == line and "Traceback" not in out, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_with_503s_then_exits_0(artifact, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(artifact, "--port", port, "--kv-memory", "16MiB", "--drain-timeout", 60)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        lines: list[str] = []
        # a stream of seconds, not tenths: under a loaded CI machine's other worker the drain must outlast the
        # checks below by a wide margin, or the server has finished it and closed its listener
        body = {"prompt": "Tell a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        time.sleep(0.002)           # a slow reader: the stream outlives the signal
        reader = threading.Thread(target=stream)
        reader.start()
        while not lines:
            time.sleep(0.01)
        proc.send_signal(sig)
        deadline = time.time() + 10
        while (health := httpx.get(f"{url}/health", timeout=10)).status_code == 200 and time.time() < deadline:
            time.sleep(0.01)                                     # the listener is still open while it drains
        assert reader.is_alive(), "the stream ended before the drain could be seen"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        reader.join(timeout=120)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert lines[-1] == "data: [DONE]" and sum(line.startswith("data: {") for line in lines) >= 2000
        assert "Aborted" not in out and "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
