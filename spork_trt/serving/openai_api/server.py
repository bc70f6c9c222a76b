"""uvicorn in a thread of `serve`: started after Triton is ready, stopped before Triton drains; a daemon thread,
so it dies with the process however `serve` ends."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from spork_trt.errors import UserError
from spork_trt.serving.openai_api.gate import GateConfig


@dataclass(frozen=True)
class FrontConfig:
    repo: Path  # the rendered repository Triton serves (its spork config names the engines)
    grpc_url: str  # Triton's gRPC host:port
    host: str = "127.0.0.1"
    port: int = 9000  # 0: off
    model_name: str | None = None  # None: the build's source checkpoint's name
    drain_timeout_s: float = 30.0  # on stop: in-flight answers get this long to finish (as Triton's drain)
    start_timeout_s: float = 30.0
    max_body_bytes: int = 4 * 2**20  # a larger request body is refused while it is read (413)
    gate: GateConfig = GateConfig()  # API keys, the Host and Origin allow-lists (openai_api/gate.py)
    max_connections: int = 1024  # open connections and requests at once; more are answered 503 at once
    chat_template: str | None = None  # --chat-template: "generic", a Jinja file, or None (model.tool_format)


def refuse_port_in_use(host: str, port: int) -> None:
    """Checked before Triton starts, so a taken port fails `serve` at once."""
    from spork_trt.serving.triton_server import refuse_ports_in_use

    refuse_ports_in_use(host, {"--openai-port (0: no OpenAI API)": port})


class OpenAIServer:
    """`start()` returns once the port answers; `stop()` drains it and joins the thread."""

    def __init__(self, cfg: FrontConfig) -> None:
        self.cfg, self.server, self.thread = cfg, None, None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}/v1"

    def start(self) -> OpenAIServer:
        import uvicorn

        from spork_trt.serving.openai_api.app import create_app
        from spork_trt.serving.openai_api.model import load_served_model

        model = load_served_model(self.cfg.repo, self.cfg.model_name, self.cfg.chat_template)
        self.model_name = model.name
        config = uvicorn.Config(create_app(model, self.cfg.grpc_url, self.cfg.max_body_bytes, self.cfg.gate), host=self.cfg.host, port=self.cfg.port,
                                log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=max(1, round(self.cfg.drain_timeout_s)),
                                limit_concurrency=self.cfg.max_connections, timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="openai-api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise UserError(f"the OpenAI API did not start on {self.cfg.host}:{self.cfg.port} (is the port in "
                                "use? choose another with --openai-port, or 0 for none)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stop listening at once; in-flight answers get the drain timeout to finish."""
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(self.cfg.drain_timeout_s + 5.0)
