"""`serve` as an operator runs it: nothing of the server outlives the launcher however it ends (SIGHUP, a second
Ctrl-C during the drain, SIGKILL), SIGTERM drains (the in-flight stream finishes, new requests are refused, exit 0),
a port already in use is refused before starting, and the previous log is kept."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from spork_trt.serving.triton_client import ClientConfig, query
from spork_trt.errors import UserError
from spork_trt.serving.triton_server import ServerConfig, TritonServer, free_port, keep_previous, refuse_ports_in_use
from tests.conftest import mt_bench_prompts


def test_a_port_in_use_is_refused_before_starting(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = ServerConfig(tmp_path, grpc_port=port, http_port=free_port(), metrics_port=free_port())
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use .* --grpc-port"):
            refuse_ports_in_use(cfg.host, {"--http-port": cfg.http_port, "--grpc-port": cfg.grpc_port})
    refuse_ports_in_use(cfg.host, {"--grpc-port": cfg.grpc_port})  # free again


@pytest.mark.parametrize("host,needle", [("::1", "IPv6"), ("[::1]", "IPv6"), ("::", "IPv6"),
                                         ("no-such-host.invalid", "no such IPv4 address")])
def test_an_address_the_servers_cannot_bind_is_named_not_called_a_port_in_use(host, needle):
    with pytest.raises(UserError, match=needle) as e:
        refuse_ports_in_use(host, {"--http-port": free_port()})
    assert "in use" not in str(e.value)


def test_the_guard_takes_its_command_through_the_pipe_not_its_argv(tmp_path):
    """The command holds the admin key: no local user reads it in the guard's /proc/PID/cmdline."""
    from spork_trt.serving.triton_guard import guarded

    out = tmp_path / "out"
    with out.open("w") as f:
        p = guarded([sys.executable, "-c", "import sys, time; time.sleep(1); print(sys.argv[1])", "spork-admin-key=s3"],
                    5.0, stdout=f)
        try:
            assert "s3" not in " ".join(psutil.Process(p.pid).cmdline())
            assert p.wait(30) == 0
        finally:
            p.stdin.close()
    assert out.read_text().strip() == "spork-admin-key=s3"


def test_the_previous_log_is_kept(tmp_path):
    log = tmp_path / "logs" / "tritonserver.log"
    keep_previous(log)
    assert not log.exists()
    log.write_text("first run")
    keep_previous(log)
    assert (tmp_path / "logs" / "tritonserver.log.1").read_text() == "first run" and not log.exists()


def launch(engines: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int, str]:
    """`serve` in a subprocess, ready; returns it, its server's process group (the guard's pid) and its HTTP url."""
    p, guards, ports = launch_all(engines, tmp_path, *extra)
    assert len(guards) == 1
    return p, guards[0], f"127.0.0.1:{ports[0]}"


def launch_all(engines: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, list[int], list[str]]:
    """`serve` in a subprocess, ready; returns it, the process groups it leads (each guard's pid: a tritonserver's
    or haproxy's) and its public ports (HTTP, gRPC, metrics). The repository has one instance of each model and the
    build's ONNX target (fewer stubs, quicker loads, no spinning OpenMP threads beside a second replica: these tests
    are about the processes)."""
    from spork_trt.serving.triton_repo import RepoConfig, render

    repo = render(RepoConfig(engines, tmp_path / "repo", slots=2, unary_instances=1, device=""))
    ports = [str(free_port()) for _ in range(3)]
    err = (tmp_path / "launcher.err").open("w")  # a file, not a pipe nobody reads
    p = subprocess.Popen([sys.executable, "-m", "spork_trt", "serve", "--repo", str(repo),
                          "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
                          "--openai-port", str(free_port()), "--log", str(tmp_path / "triton.log"), *extra], stderr=err, text=True)
    deadline = time.monotonic() + 300
    while "ready:" not in (tmp_path / "launcher.err").read_text():
        assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.err").read_text()
        time.sleep(0.2)
    guards = [c.pid for c in psutil.Process(p.pid).children() if "triton_guard" in " ".join(c.cmdline())]
    return p, guards, ports


def group_members(group: int) -> list[str]:
    out = []
    for q in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(q.pid) == group and q.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{q.pid} {q.name()}")
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def wait_group_gone(group: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := group_members(group)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGHUP", "SIGINT twice", "SIGKILL"])
def test_nothing_outlives_the_launcher(default_engines, tmp_path, how):
    p, group, _ = launch(default_engines, tmp_path, "--drain-timeout", "5")
    try:
        assert len(group_members(group)) >= 3  # the guard, tritonserver, python backend stubs
        if how == "SIGINT twice":
            p.send_signal(signal.SIGINT)
            time.sleep(0.3)
            p.send_signal(signal.SIGINT)
        else:
            p.send_signal(getattr(signal, how))
        p.wait(timeout=60)
        assert wait_group_gone(group, 5 + 15 + 20) == []  # drain timeout + the guard's margin + slack
    finally:
        p.kill()
        if group_members(group):
            os.killpg(group, signal.SIGKILL)


@pytest.mark.slow
def test_sigterm_drains_the_stream_in_flight(default_engines, tmp_path):
    """Readiness false and new requests refused at once; the stream in flight runs to its end; exit code 0."""
    p, group, url = launch(default_engines, tmp_path, "--drain-timeout", "60")
    try:
        first, reply = threading.Event(), {}
        prompt = mt_bench_prompts(1)[0]
        cfg = ClientConfig(url=url, protocol="generate", stream=True, max_tokens=96, spec_mode="plain")
        t = threading.Thread(target=lambda: reply.update(r=query(prompt, cfg, lambda _: first.set())))
        t.start()
        assert first.wait(120)
        p.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(UserError):
            query("hi", ClientConfig(url=url, protocol="generate", max_tokens=4, retries=0))
        t.join(120)
        assert reply["r"].stop_reason in ("eos", "max_tokens") and reply["r"].stats["num_steps"] >= 1
        assert p.wait(timeout=90) == 0, (tmp_path / "launcher.err").read_text()[-2000:]
        assert "every request finished" in (tmp_path / "launcher.err").read_text()
        assert wait_group_gone(group, 10) == []
    finally:
        p.kill()
        if group_members(group):
            os.killpg(group, signal.SIGKILL)
