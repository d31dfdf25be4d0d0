"""`kiln serve`: the app under uvicorn on loopback (unless told otherwise).

The port is bound before anything loads: a busy port is one line and exit 2, at once. The model then
loads in the background (/health answers 503 "loading"); a model that fails to load stops the server
and `serve` raises its error, the one line `kiln run` prints for it.

SIGTERM or Ctrl-C drains: /health and new requests get 503 while the requests already running
finish (up to `drain_timeout` seconds), the listener still open so a load balancer sees the 503s;
then the process exits 0. A second Ctrl-C stops at once.
"""
from __future__ import annotations

import signal
import socket
import time

import uvicorn

from kiln.errors import KilnError

from .app import ServerConfig, ServerState, create_app


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (the first address host resolves to), or KilnError in one line."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise KilnError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # a restart may reuse a port in TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise KilnError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn, with a signal starting a drain instead of closing the listener (and no signal raised
    again at the end, so the process exits 0), and a load failure ending the server."""

    def __init__(self, config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.kiln_state, self.drain_timeout = state, drain_timeout
        self.drain_deadline: float | None = None

    def handle_exit(self, sig, frame):
        if self.drain_deadline is not None and sig == signal.SIGINT:      # a second Ctrl-C: now
            self.should_exit = self.force_exit = True
            return
        self.kiln_state.draining = True
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_timeout

    async def on_tick(self, counter: int) -> bool:
        state = self.kiln_state
        drained = self.drain_deadline is not None and (state.active == 0 or time.monotonic() >= self.drain_deadline)
        if drained or state.load_error:
            self.should_exit = True
        return await super().on_tick(counter)


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
          log_level: str = "info") -> None:
    sock = bind(host, port)
    app = create_app(config)
    # the drain happens before uvicorn's shutdown begins: by then nothing runs but what outlived it
    server = DrainingServer(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=1),
                            app.state.kiln, drain_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if app.state.kiln.load_error:
        raise KilnError(app.state.kiln.load_error)
