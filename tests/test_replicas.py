"""`serve --replicas N`: N tritonservers behind a real haproxy. Its configuration is valid for haproxy itself; the
replicas share the load over HTTP, gRPC streaming and the generate endpoints with the same answers; when one is
killed, every request is still answered (haproxy's retries, then the client's), and it is started again and takes its
share of the load once more; nothing outlives the launcher. The
client sends a request with no answer yet again, and reports an answer cut after its first response as
incomplete."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import psutil
import pytest

from spork_trt.serving.triton_client import ClientConfig, Collector, failure, query
from spork_trt.errors import Unanswered, UserError
from spork_trt.serving.replicas import BalancerConfig, ReplicaSet, find_haproxy, haproxy_config
from spork_trt.serving.triton_server import ServerConfig, free_port
from tests.conftest import mt_bench_prompts
from tests.test_serve_lifecycle import group_members, launch_all, wait_group_gone


def test_the_balancer_configuration_is_valid_for_haproxy(tmp_path):
    replicas = [replace(ServerConfig(tmp_path), http_port=free_port(), grpc_port=free_port()) for _ in range(3)]
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config("127.0.0.1", free_port(), free_port(), replicas))
    checked = subprocess.run([find_haproxy(), "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    text = cfg.read_text()
    assert text.count("check inter") == 6 and "retry-on conn-failure empty-response 503" in text
    assert text.count("observe layer7 error-limit 10 on-error mark-down") == 3  # the HTTP backends only
    assert all(f"port {r.http_port} check-proto h1" in text for r in replicas)  # gRPC backends: HTTP readiness


@contextlib.contextmanager
def balancer(tmp_path, replicas: list, b: BalancerConfig):
    """The real haproxy on our configuration for `replicas`, accepting connections: yields its HTTP port."""
    import socket

    port, cfg = free_port(), tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config("127.0.0.1", port, free_port(), replicas, b))
    proc = subprocess.Popen([find_haproxy(), "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "haproxy did not start"
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_client_that_sends_its_headers_slowly_is_cut_by_the_balancer(tmp_path):
    """Slowloris: a connection whose request headers do not all arrive within request_timeout_s gets haproxy's 408
    and is closed, instead of holding a connection for the idle timeout (600 s)."""
    import socket
    import time

    replicas = [replace(ServerConfig(tmp_path), http_port=free_port(), grpc_port=free_port()) for _ in range(2)]
    with balancer(tmp_path, replicas, BalancerConfig(request_timeout_s=1.0)) as port:
        conn = socket.create_connection(("127.0.0.1", port), timeout=1)
        with conn:
            conn.settimeout(10)
            t0 = time.monotonic()
            conn.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            answer = conn.recv(4096)
            waited = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 408") and waited < 5, (answer[:40], waited)


def test_a_replica_that_is_ready_but_fails_requests_is_taken_out_of_the_rotation(tmp_path):
    """Two stand-in replicas behind the real haproxy with our configuration, both ready; one answers every request
    500 at once. Least connections alone sends it about half of 60 requests in a row; observing answers
    (error_limit consecutive 5xx), haproxy takes it out after 3 until its next health check passes."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    hits = {"good": 0, "bad": 0}

    def handler(kind: str):
        class H(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # readiness: both ready
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hits[kind] += 1
                self.send_response(200 if kind == "good" else 500)
                self.send_header("Content-Length", "0")
                self.end_headers()
        return H

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler(k)) for k in ("good", "bad")]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    replicas = [replace(ServerConfig(tmp_path), http_port=s.server_address[1], grpc_port=free_port()) for s in servers]
    try:
        with balancer(tmp_path, replicas, BalancerConfig(error_limit=3)) as port:
            statuses = []
            for _ in range(60):
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/m/infer", data=b"{}", method="POST")
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        statuses.append(r.status)
                except urllib.error.HTTPError as e:
                    statuses.append(e.code)
        assert hits["bad"] <= 3 + 3 and statuses.count(200) == hits["good"] >= 54, (hits, statuses)
    finally:
        for s in servers:
            s.shutdown()


def test_replica_counts_outside_2_to_16_are_refused(tmp_path):
    for n in (0, 17):
        with pytest.raises(UserError, match="--replicas must be in 2..16"):
            ReplicaSet(ServerConfig(tmp_path), n)


def test_a_request_nobody_answers_is_sent_again_then_fails():
    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    for protocol in ("generate", "http", "grpc"):
        t = time.perf_counter()
        with pytest.raises(UserError, match="sent 3 times"):
            query("hi", ClientConfig(url=url, protocol=protocol, stream=protocol == "grpc", retries=2,
                                     backoff_s=0.1, timeout_s=10))
        assert time.perf_counter() - t >= 0.1 + 0.2  # the backoff before each retry


def test_an_answer_cut_after_its_first_response_is_incomplete_and_never_sent_again():
    col = Collector(None)
    assert isinstance(failure("lost", col, retry=True), Unanswered)
    assert not isinstance(failure("bad field", col, retry=False), Unanswered)
    col.add({"text_output": b"Hello", **{k: 0.0 for k in ("acceptance_rate", "total_accepted_draft_tokens",
                                                           "total_draft_tokens", "mean_accepted_length",
                                                           "num_steps")}})
    cut = failure("lost", col, retry=True)
    assert not isinstance(cut, Unanswered) and "cut after 1 responses and is incomplete" in str(cut)


def served(metrics_url: str) -> float:
    """Requests the replica's preprocessing model answered (every ensemble request passes it)."""
    text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5).read().decode()
    return sum(float(m) for m in re.findall(r'nv_inference_request_success\{model="preprocessing"[^}]*\} (\S+)', text))


@pytest.mark.slow
def test_two_replicas_share_the_load_and_one_killed_loses_no_request(default_engines, tmp_path):
    p, guards, ports = launch_all(default_engines, tmp_path, "--replicas", "2", "--drain-timeout", "5")
    groups = list(guards)
    try:
        tritons = [g for g in guards if any("tritonserver" in c.name() for c in psutil.Process(g).children())]
        assert len(guards) == 3 and len(tritons) == 2  # two replicas and haproxy, each in a guarded group
        ready = (tmp_path / "launcher.err").read_text()
        metrics = re.findall(r"metrics (127\.0\.0\.1:\d+)", ready)
        http, grpc = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"

        def ask(prompt: str, protocol: str) -> str:
            return query(prompt, ClientConfig(url=grpc if protocol == "grpc" else http, protocol=protocol,
                                              stream=protocol != "http", max_tokens=24, spec_mode="plain",
                                              backoff_s=0.2)).text

        prompts = mt_bench_prompts(3)
        want = {q: ask(q, "grpc") for q in prompts}
        jobs = [(q, proto) for q in prompts for proto in ("grpc", "http", "generate")] * 2
        with ThreadPoolExecutor(6) as pool:  # at once: least connections sends them to both replicas
            got = list(pool.map(lambda j: ask(*j), jobs))
        assert got == [want[q] for q, _ in jobs] and all(want.values())
        assert len(metrics) == 2 and all(served(m) > 0 for m in metrics), metrics

        os.killpg(tritons[0], signal.SIGKILL)  # a replica crashes: its server and stubs are gone at once
        assert wait_group_gone(tritons[0], 10) == []
        got = [ask(q, proto) for q, proto in jobs]
        assert got == [want[q] for q, _ in jobs]
        assert p.poll() is None  # the set serves on with one replica, and says which one left
        deadline = time.monotonic() + 10
        while not re.search(r"replica r\d exited \(code", (tmp_path / "launcher.err").read_text()):
            assert time.monotonic() < deadline, (tmp_path / "launcher.err").read_text()
            time.sleep(0.2)
        # and it is started again on its own ports, in a guarded group of its own, and haproxy takes it back
        deadline = time.monotonic() + 180
        while not re.search(r"replica r\d is serving again", (tmp_path / "launcher.err").read_text()):
            assert time.monotonic() < deadline and p.poll() is None, (tmp_path / "launcher.err").read_text()
            time.sleep(0.5)
        groups += [c.pid for c in psutil.Process(p.pid).children() if "triton_guard" in " ".join(c.cmdline())
                   and c.pid not in groups]
        assert len(groups) == 4
        time.sleep(2 * BalancerConfig.check_ms / 1000)  # haproxy's next health check marks it up
        before = [served(m) for m in metrics]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda j: ask(*j), jobs))
        assert got == [want[q] for q, _ in jobs]
        assert all(served(m) > b for m, b in zip(metrics, before)), (before, [served(m) for m in metrics])
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=90)
        finally:
            p.kill()
        for g in groups:
            assert wait_group_gone(g, 30) == [], group_members(g)
