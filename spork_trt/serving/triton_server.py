"""Launch Triton Inference Server on a rendered repository: loopback only by default, closed model control, wait
until ready, log to a file, shut down cleanly.

Closed by default: `--model-control-mode=none` loads exactly the rendered repository at start and refuses every
load and unload request (over HTTP and gRPC), since a client that may load a python-backend model can run code in
the server. The administrative APIs (the repository index, shared-memory registration, log and trace settings)
and those that tell a client about the build or about other clients (each model's configuration, with its engine
paths; the statistics, with every client's counts) answer only clients that send the operator's key in the
`spork-admin-key` header (ServerConfig.admin_key, from SPORK_ADMIN_KEY; none set: a random key nobody knows, so they
are off).

The binary is the `tritonserver` on PATH if there is one, else the CPU build inside the nvidia-pytriton wheel
(DESIGN.md section 7): its python backend is copied once into a private folder together with the stub for this
Python, and the venv's `bin` goes first on PATH so the stub's Python imports spork_trt from this environment.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from spork_trt.errors import UserError
from spork_trt.serving.triton_guard import guarded

MODELS = ("preprocessing", "spork", "spork_unary", "postprocessing", "ensemble", "ensemble_unary")
# Triton's restricted-API groups held behind the operator's key (model control is also off: mode none): the
# repository, shared memory, logs, traces, and what tells one client about the build or about other clients
ADMIN_APIS = "model-repository,shared-memory,logging,trace,model-config,statistics"
ADMIN_HEADER = "spork-admin-key"
GUARD_MARGIN_S = 15.0  # past the drain timeout, before the group is killed


@dataclass(frozen=True)
class ServerConfig:
    repo: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_file: Path | None = None  # None: REPO/../logs/tritonserver.log (beside the engines, outside the repository)
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0  # on stop: in-flight requests get this long to finish (Triton's exit timeout)
    # the key of the administrative APIs (header ADMIN_HEADER); "": a random key per start, so they are off
    admin_key: str = field(default_factory=lambda: os.environ.get("SPORK_ADMIN_KEY", ""))

    @property
    def log(self) -> Path:
        return self.log_file or self.repo.resolve().parent / "logs" / "tritonserver.log"


@dataclass(frozen=True)
class Binary:
    path: Path
    env: dict[str, str]  # the environment tritonserver runs with
    backend_dir: Path | None  # None: the installation's own


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_binary() -> Binary:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    on_path = shutil.which("tritonserver")
    if on_path:
        return Binary(Path(on_path), env, None)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("no tritonserver on PATH and the nvidia-pytriton wheel is not installed: run `make setup`")
    root = Path(spec.submodule_search_locations[0]) / "tritonserver"
    libs = [str(root.parents[1] / "nvidia_pytriton.libs")]
    libpython = Path(sysconfig.get_config_var("LIBDIR") or "") / (sysconfig.get_config_var("LDLIBRARY") or "-")
    if libpython.is_file():  # the stub must embed this interpreter's libpython, not another 3.11 on the system
        libs.insert(0, str(libpython.parent))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in (os.environ.get("LD_LIBRARY_PATH"),) if p])
    return Binary(root / "bin" / "tritonserver", env, private_python_backend(root))


def private_python_backend(root: Path) -> Path:
    """A copy of the wheel's python backend with the stub for this Python (the installed wheel stays untouched)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(f"nvidia-pytriton has no python backend stub for Python {version}")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spork_trt" / "triton"
    backends = cache / f"backends-{stub.stat().st_size}-{int(stub.stat().st_mtime)}-py{version}"
    python = backends / "python"
    if not (python / "triton_python_backend_stub").is_file():
        tmp = backends.with_name(backends.name + f".tmp{os.getpid()}")
        shutil.copytree(root / "backends" / "python", tmp / "python", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
        if backends.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(backends)
    return backends


def command(cfg: ServerConfig, binary: Binary) -> list[str]:
    key = cfg.admin_key or secrets.token_hex(16)
    restricted = f"{ADMIN_APIS}:{ADMIN_HEADER}={key}"
    cmd = [str(binary.path), f"--model-repository={cfg.repo.resolve()}", "--model-control-mode=none",
           "--exit-on-error=true", "--strict-readiness=true",
           f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
           f"--http-address={cfg.host}", f"--http-port={cfg.http_port}",
           f"--grpc-address={cfg.host}", f"--grpc-port={cfg.grpc_port}",
           f"--metrics-address={cfg.host}", f"--metrics-port={cfg.metrics_port}", "--log-verbose=0",
           f"--exit-timeout-secs={max(1, round(cfg.drain_timeout_s))}"]
    if binary.backend_dir is not None:
        cmd.append(f"--backend-directory={binary.backend_dir}")
    return cmd


def refuse_host(host: str) -> None:
    """An address the servers cannot bind is refused in one line, not reported as a port in use: an IPv6 address
    (Triton's HTTP server binds IPv4 only: triton-inference-server/server#5305) or a name that does not resolve."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            socket.getaddrinfo(host, None, socket.AF_INET)
        except socket.gaierror:
            raise UserError(f"--host {host}: no such IPv4 address or host name") from None
        return
    if ip.version == 6:
        raise UserError(f"--host {host}: Triton's HTTP server cannot listen on an IPv6 address; use 127.0.0.1 "
                        "(loopback, the default) or 0.0.0.0 (every IPv4 interface)")


def refuse_ports_in_use(host: str, ports: dict[str, int]) -> None:
    """A port already answering would make `serve` report ready for somebody else's server: refuse before starting.
    ports: the flag that sets it -> port."""
    refuse_host(host)
    for flag, port in ports.items():
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no owner
            try:
                sock.bind((host, port))
            except OSError:
                raise UserError(f"port {port} on {host} is in use (another server?): stop it or choose another "
                                f"{flag}") from None


def keep_previous(log: Path) -> None:
    """The last run's log stays beside the new one as LOG.1 (one generation)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if log.is_file():
        log.replace(log.with_name(log.name + ".1"))


def kill_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL every process left in a process group and wait (bounded) until the group is gone."""
    deadline = time.monotonic() + timeout_s
    try:
        os.killpg(pgid, signal.SIGKILL)
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # raises once no process of the group is left
            time.sleep(0.05)
    except (ProcessLookupError, PermissionError):
        pass


class Addressed:
    """The addresses clients use of a server (or a set of them) configured by `cfg`."""

    cfg: ServerConfig

    @property
    def http_url(self) -> str:
        return f"{self.cfg.host}:{self.cfg.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.cfg.host}:{self.cfg.grpc_port}"


def wait_http_ok(url: str, proc: subprocess.Popen, timeout_s: float, period_s: float = 0.5) -> str:
    """Poll `url` until it answers 200 while `proc` runs: "ready", "exited" (`proc` ended first) or "timeout"."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "exited"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return "ready"
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(period_s)
    return "timeout"


class TritonServer(Addressed):
    """`with TritonServer(cfg) as server:` a ready server; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, cfg: ServerConfig) -> None:
        from spork_trt.serving.triton_repo import is_rendered

        if not is_rendered(cfg.repo):
            raise UserError(f"{cfg.repo} is not a rendered repository: run `python -m export triton` first")
        self.cfg, self.proc = cfg, None

    def start(self) -> TritonServer:
        refuse_ports_in_use(self.cfg.host, {"--http-port": self.cfg.http_port, "--grpc-port": self.cfg.grpc_port,
                                            "--metrics-port": self.cfg.metrics_port})
        binary = find_binary()
        keep_previous(self.cfg.log)
        with open(self.cfg.log, "w") as log:  # the child keeps its own handle
            # the guard leads the server's process group and takes it down when this process ends, however it ends:
            # it watches the pipe whose write end only this process holds; the command (with the admin key) goes
            # through that pipe, not the guard's argv (triton_guard.py)
            self.proc = guarded(command(self.cfg, binary), self.cfg.drain_timeout_s + GUARD_MARGIN_S, env=binary.env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:  # Ctrl-C or SIGTERM while starting: nothing may outlive the launcher
            self.stop(timeout_s=10.0)
            raise
        return self

    def wait_ready(self) -> None:
        """Until the ensemble is ready and the metrics endpoint answers (Triton starts its metrics service after the
        HTTP one: a client that read readiness then scraped the metrics could find nobody listening)."""
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        state = wait_http_ok(f"http://{self.http_url}/v2/models/ensemble/ready", self.proc, self.cfg.ready_timeout_s)
        if state == "ready":
            state = wait_http_ok(f"http://{self.cfg.host}:{self.cfg.metrics_port}/metrics", self.proc,
                                 max(deadline - time.monotonic(), 1.0), period_s=0.05)
        if state == "exited":
            raise UserError(f"tritonserver exited with code {self.proc.returncode} while starting; its log "
                            f"({self.cfg.log}) ends with:\n{self.log_tail()}")
        if state == "timeout":
            self.stop()
            raise UserError(f"tritonserver was not ready after {self.cfg.ready_timeout_s:.0f}s; log: {self.cfg.log}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def replace_stalled(self, pids: list[str]) -> bool:
        """An instance of this server stopped serving (watchdog.py): a single server cannot replace it while it
        serves; `serve` stops it (a replica set restarts the replica instead)."""
        return False

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.cfg.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Drain: SIGTERM (Triton refuses new requests and reports not ready at once, lets in-flight ones finish
        within the drain timeout, unloads the models and stops their stubs); SIGKILL to the whole group after
        `timeout_s` (default: the drain timeout and a margin) or on a second Ctrl-C, so the ports are free when this
        returns. Returns tritonserver's exit code: 0 when everything finished."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(self.cfg.drain_timeout_s + GUARD_MARGIN_S if timeout_s is None else timeout_s)
                except subprocess.TimeoutExpired:
                    pass
        finally:  # a second Ctrl-C lands here too: escalate at once
            kill_group(self.proc.pid)  # start_new_session: the group id is the guard's pid
        return self.proc.wait()

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
