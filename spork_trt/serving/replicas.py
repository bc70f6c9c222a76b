"""Several Triton replicas behind haproxy on one machine (`serve --replicas N`).

    clients --> haproxy (the public --http-port / --grpc-port) --> replica i: tritonserver on loopback ports of its own

Each replica is a whole `serve` server (its own engine core and KV pool, closed model control, guarded by
triton_guard), on free loopback ports; haproxy (the Debian package, `make setup` installs it) is the only thing
on the public ports. It health-checks every replica's readiness (GET /v2/health/ready on its HTTP port, every
`check_ms`): a replica that drains (SIGTERM: not ready at once), dies or hangs leaves the rotation after `fall`
failed checks and comes back when ready. HTTP is balanced per request (least connections) and a request whose
connection fails, or that is refused with 503 (a full queue, a draining replica), is sent to another replica
(haproxy's L7 retries); gRPC (HTTP/2) is balanced per call, retried only when the connection fails. What haproxy
cannot retry (a gRPC call refused UNAVAILABLE, a stream cut mid-way) the clients retry themselves, before the first
token only (triton_client.py). haproxy runs under triton_guard too: nothing outlives the launcher.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from spork_trt.errors import UserError
from spork_trt.serving.triton_guard import guarded
from spork_trt.serving.triton_server import (
    GUARD_MARGIN_S,
    Addressed,
    ServerConfig,
    TritonServer,
    find_binary,
    free_port,
    kill_group,
    refuse_ports_in_use,
    wait_http_ok,
)


@dataclass(frozen=True)
class BalancerConfig:
    check_ms: int = 1000  # health check period per replica
    fall: int = 2  # failed checks before a replica leaves the rotation
    rise: int = 1  # passed checks before it comes back
    idle_timeout_s: float = 600.0  # a connection with nothing sent either way for this long is closed
    request_timeout_s: float = 10.0  # a client's request headers must arrive within this (a slow sender is cut)
    restarts: int = 3  # times a replica that exits is started again (on its own ports; haproxy takes it back)
    error_limit: int = 10  # consecutive 5xx HTTP answers (haproxy's `observe layer7`; 501 and 505 excepted) that
    # take a replica out of the rotation until a health check passes: a replica that is ready but fails requests
    # fast no longer draws more of them (leastconn)


def haproxy_config(host: str, http_port: int, grpc_port: int, replicas: list[ServerConfig],
                   b: BalancerConfig = BalancerConfig()) -> str:
    """haproxy.cfg: the public HTTP and gRPC ports, each replica's HTTP and gRPC ports behind them, health-checked
    on the replica's HTTP readiness; HTTP answers observed too (b.error_limit; gRPC's errors travel in trailers,
    which haproxy does not observe)."""
    check = f"check inter {b.check_ms} fall {b.fall} rise {b.rise}"
    idle = f"{round(b.idle_timeout_s * 1000)}ms"
    lines = [
        "global", "    maxconn 4096", "",
        "defaults", "    mode http", "    timeout connect 2s", f"    timeout client {idle}",
        f"    timeout http-request {round(b.request_timeout_s * 1000)}ms", "    timeout http-keep-alive 10s",
        f"    timeout server {idle}", "    retries 2", "    option redispatch 1", "",
        "frontend http_in", f"    bind {host}:{http_port}", "    default_backend http_replicas", "",
        "frontend grpc_in", f"    bind {host}:{grpc_port} proto h2", "    default_backend grpc_replicas", "",
        "backend http_replicas", "    balance leastconn", "    option http-server-close",  # no idle connection
        # to a replica left open: tritonserver's drain waits for every HTTP connection, and haproxy's idle pool kept
        # one until the drain timed out (bench soak --faults)
        "    option httpchk GET /v2/health/ready",
        "    http-check expect status 200", "    retry-on conn-failure empty-response 503",
        *(f"    server r{i} {r.host}:{r.http_port} {check} observe layer7 error-limit {b.error_limit} on-error "
          "mark-down" for i, r in enumerate(replicas)), "",
        "backend grpc_replicas", "    balance leastconn", "    option httpchk GET /v2/health/ready",
        "    http-check expect status 200", "    retry-on conn-failure",
        *(f"    server r{i} {r.host}:{r.grpc_port} proto h2 {check} port {r.http_port} check-proto h1"
          for i, r in enumerate(replicas)), "",
    ]
    return "\n".join(lines)


def find_haproxy() -> str:
    path = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
                                            if Path(p).is_file()), None)
    if path is None:
        raise UserError("--replicas needs haproxy, the load balancer in front of them: `make setup` installs it "
                        "(apt-get install haproxy)")
    return path


class ReplicaSet(Addressed):
    """`n` TritonServers on loopback ports of their own behind haproxy on `cfg`'s public ports; the same surface as
    one TritonServer (start, stop, http_url, grpc_url, alive)."""

    def __init__(self, cfg: ServerConfig, n: int, balancer: BalancerConfig = BalancerConfig()) -> None:
        if not 2 <= n <= 16:
            raise UserError(f"--replicas must be in 2..16 (1: one server, no load balancer), got {n}")
        self.cfg, self.balancer, self.lb = cfg, balancer, None
        self.reported: set[int] = set()  # replicas whose exit alive() has reported
        self.restarting: dict[int, threading.Thread] = {}  # replica -> the thread starting it again
        self.restarted = [0] * n  # restarts so far, per replica
        self.stopping = False
        self.haproxy = find_haproxy()
        self.servers = [TritonServer(replace(cfg, host="127.0.0.1", http_port=free_port(), grpc_port=free_port(),
                                             metrics_port=free_port(),
                                             log_file=cfg.log.with_name(f"tritonserver.r{i}.log")))
                        for i in range(n)]

    @property
    def config_file(self) -> Path:
        return self.cfg.log.with_name("haproxy.cfg")

    def alive(self) -> bool:
        """haproxy runs and at least one replica does (or is being started again). A replica found exited is
        reported once on stderr and started again in the background, up to `restarts` times."""
        for i, s in enumerate(self.servers):
            if s.proc is not None and s.proc.poll() is not None and i not in self.reported and i not in \
                    self.restarting:
                self.reported.add(i)
                again = not self.stopping and self.restarted[i] < self.balancer.restarts
                print(f"replica r{i} exited (code {s.proc.returncode}); haproxy routes around it; its log: "
                      f"{s.cfg.log}" + (f"; starting it again ({self.restarted[i] + 1} of {self.balancer.restarts})"
                                        if again else ""), file=sys.stderr, flush=True)
                if again:
                    self.restarted[i] += 1
                    self.restarting[i] = threading.Thread(target=self.restart, args=(i,), daemon=True)
                    self.restarting[i].start()
        up = any(s.alive() for s in self.servers) or any(t.is_alive() for t in self.restarting.values())
        return self.lb is not None and self.lb.poll() is None and up

    def replace_stalled(self, pids: list[str]) -> bool:
        """Processes (a spork stub each) whose engine loop stopped serving (watchdog.py): the replicas holding them
        are killed, and alive() starts them again (a stub of no current replica was replaced already). False if a
        replica may not be started again: `serve` then stops every replica."""
        groups = {s.proc.pid: i for i, s in enumerate(self.servers) if s.proc is not None}
        found = []
        for pid in pids:
            try:
                i = groups.get(os.getpgid(int(pid)))
            except ProcessLookupError:  # gone already: its replica's exit is seen by alive()
                continue
            if i is None:  # a stub of a replica already replaced (killed, maybe not yet reaped): its file only
                continue
            if self.restarted[i] >= self.balancer.restarts:
                return False
            found.append(i)
        for i in sorted(set(found)):
            print(f"replica r{i}: its engine loop stopped serving (no heartbeat): killing it to start it again; "
                  "haproxy routes around it", file=sys.stderr, flush=True)
            kill_group(self.servers[i].proc.pid)
        return True

    def restart(self, i: int) -> None:
        """Start replica `i` again on its ports (its previous log kept as .1); haproxy's health check adds it back."""
        s = self.servers[i]
        kill_group(s.proc.pid)  # whatever of its group is left (stubs) goes first: the ports must be free
        try:
            s.start()
            print(f"replica r{i} is serving again", file=sys.stderr, flush=True)
        except (UserError, OSError) as e:
            print(f"replica r{i} could not be started again: {e}", file=sys.stderr, flush=True)
        finally:
            self.reported.discard(i)
            self.restarting.pop(i, None)

    def start(self) -> ReplicaSet:
        refuse_ports_in_use(self.cfg.host, {"--http-port": self.cfg.http_port, "--grpc-port": self.cfg.grpc_port})
        text = haproxy_config(self.cfg.host, self.cfg.http_port, self.cfg.grpc_port, [s.cfg for s in self.servers],
                              self.balancer)
        self.config_file.parent.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(text)
        checked = subprocess.run([self.haproxy, "-c", "-q", "-f", str(self.config_file)], capture_output=True,
                                 text=True)
        if checked.returncode != 0:
            raise UserError(f"haproxy refused {self.config_file}: {checked.stderr.strip() or checked.stdout.strip()}")
        # once before the threads: sysconfig's first read of the interpreter's config is not thread-safe, and a
        # replica whose read came back empty ran its stubs on another libpython (their `import ssl` failed)
        find_binary()
        try:
            with ThreadPoolExecutor(len(self.servers)) as pool:  # the replicas load at the same time
                list(pool.map(TritonServer.start, self.servers))
            self.start_balancer()
        except BaseException:
            self.stop(timeout_s=10.0)
            raise
        return self

    def start_balancer(self) -> None:
        with open(self.cfg.log.with_name("haproxy.log"), "w") as log:
            self.lb = guarded([self.haproxy, "-db", "-f", str(self.config_file)], GUARD_MARGIN_S, stdout=log,
                              stderr=subprocess.STDOUT)
        # ready once it routes a readiness check to a ready replica
        state = wait_http_ok(f"http://{self.http_url}/v2/health/ready", self.lb, 30.0, period_s=0.2)
        if state == "exited":
            raise UserError(f"haproxy exited with code {self.lb.returncode}; see {self.cfg.log.parent}/haproxy.log")
        if state == "timeout":
            raise UserError(f"haproxy on {self.http_url} routed no readiness check to a replica within 30 s")

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Every replica drains at once (each refuses new requests and turns not ready, so haproxy stops sending it
        any; in-flight ones finish within the drain timeout), then haproxy stops. Returns 0 when every replica
        stopped cleanly, else the first other exit code."""
        self.stopping = True  # no replica is started again from here on
        with ThreadPoolExecutor(len(self.servers)) as pool:
            codes = list(pool.map(lambda s: s.stop(timeout_s), self.servers))
        if self.lb is not None:
            try:
                self.lb.terminate()
                self.lb.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
            finally:
                kill_group(self.lb.pid)
        return next((c for c in codes if c), 0) if any(c is not None for c in codes) else None

    def __enter__(self) -> ReplicaSet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
