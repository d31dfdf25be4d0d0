"""`kiln serve`: the app under uvicorn on loopback (unless told otherwise).

SIGTERM or Ctrl-C: /health turns 503 and new requests get 503 at once, the requests already
running finish (up to `drain_timeout` seconds), then the process exits.
"""
from __future__ import annotations

import uvicorn

from .app import ServerConfig, create_app


class _DrainingServer(uvicorn.Server):
    def __init__(self, config, state):
        super().__init__(config)
        self._kiln_state = state

    def handle_exit(self, sig, frame):
        self._kiln_state["draining"] = True
        super().handle_exit(sig, frame)


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
          log_level: str = "info") -> None:
    app = create_app(config)
    server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                            timeout_graceful_shutdown=drain_timeout), app.state.kiln)
    server.run()
