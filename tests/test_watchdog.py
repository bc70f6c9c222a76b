"""The watchdog (spork_trt/serving/watchdog.py): an engine loop that stops serving stops beating, and `serve` then
stops the server with exit code 3 so that it is replaced. Without a server: a step that runs past the bound and a
loop thread that dies each turn the service down (requests refused and answered at once) and end the beat; the
staleness of a beat by its age. With one: the `spork` stub stopped by SIGSTOP stops `serve` within the bound, naming
the instance, and nothing of the server is left."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import psutil
import pytest

from bench.soak_faults import spork_stubs
from spork_trt.config import SpecConfig
from spork_trt.errors import QueueFull
from spork_trt.loop.engine_core import CoreConfig
from spork_trt.serving.cancel_board import CancelBoard
from spork_trt.serving.engine_service import LOOP_STOPPED, Service
from spork_trt.serving.watchdog import Heartbeat, Watch
from tests.conftest import tiny_config

@pytest.fixture(scope="module")
def runtime():
    """A tiny random target with the default model's tokenizer (test_edge.py's)."""
    from spork_trt.checkpoint.tokenizer import load_tokenizer
    from spork_trt.checkpoint.weights import default_gguf_path, random_checkpoint
    from spork_trt.engines.torch_engine import TorchEngine
    from spork_trt.loop.runtime import Runtime

    model = random_checkpoint(tiny_config(), seed=5, scale=8.0).model
    return Runtime(model.cfg, load_tokenizer(default_gguf_path(), "gguf"), TorchEngine(model), lambda *_: None)


INPUTS = {"input_ids": np.array([[5, 6, 7, 8]], np.int32), "max_tokens": np.array([[8]], np.int32)}  # [1, n]


@pytest.mark.parametrize("how", ["a step that does not end", "a dead loop thread"])
def test_a_loop_that_stops_serving_stops_the_beat_and_refuses_requests(runtime, tmp_path, how):
    svc = Service(runtime, SpecConfig.for_draft("ngram"), CoreConfig(slots=2, max_len=128),
                  board=CancelBoard(tmp_path / "board"))
    release, real = threading.Event(), svc.core.step

    def step():
        if how == "a dead loop thread":
            raise SystemExit("gone")  # a BaseException: the loop itself ends
        release.wait(30)
        return real()

    watch = Watch(tmp_path / "beats", bound_s=0.5)
    watch.folder.mkdir()
    beat = Heartbeat(svc, watch)
    try:
        beat.tick()  # idle: serving
        assert beat.path.exists() and beat.down is None and watch.stale() == []
        svc.core.step = step
        failed = []
        svc.submit(INPUTS, send=lambda chunk: None, fail=failed.append)
        time.sleep(1.0)
        before = beat.path.stat().st_mtime
        beat.tick()
        assert beat.down and ("stalled" in beat.down if how.startswith("a step") else beat.down == LOOP_STOPPED)
        assert len(failed) == 1 and isinstance(failed[0], QueueFull)  # its request answered at once
        with pytest.raises(QueueFull):
            svc.submit(INPUTS, send=lambda chunk: None, fail=failed.append)
        beat.tick()  # the beat stays stopped
        assert beat.path.stat().st_mtime == before
        assert watch.stale(now=time.time() + 1) == [str(os.getpid())] and not svc.healthy
    finally:
        release.set()
        svc.close()
        beat.stop()
    assert watch.stale(now=time.time() + 1) == []  # an instance unloaded normally is no stale beat


def test_stale_beats_by_age(tmp_path):
    watch = Watch(tmp_path, bound_s=10)
    for name, age in (("101", 3), ("102", 11), ("103", 60)):
        (tmp_path / name).touch()
        os.utime(tmp_path / name, (time.time() - age, time.time() - age))
    assert watch.stale() == ["102", "103"]
    assert Watch(tmp_path / "none").stale() == []  # nothing beat yet
    assert Watch.from_env() is None or os.environ.get("SPORK_HEARTBEAT_DIR")


@pytest.mark.slow
def test_a_stopped_engine_stub_stops_serve_with_code_3_and_nothing_is_left(default_engines, tmp_path):
    from tests.test_serve_lifecycle import launch, wait_group_gone

    p, group, _ = launch(default_engines, tmp_path, "--stall-timeout", "4", "--drain-timeout", "5")
    try:
        stubs = spork_stubs(group)
        assert len(stubs) == 1, stubs
        time.sleep(1.5)  # beating
        stubs[0].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert p.wait(timeout=60) == 3
        waited = time.monotonic() - t0
        err = (tmp_path / "launcher.err").read_text()
        assert f"spork instance(s) {stubs[0].pid} stopped serving" in err and "replaced" in err, err
        assert 4 <= waited < 30, waited  # the bound, then a bounded stop
        assert wait_group_gone(group, 30) == []
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_with_two_replicas_a_stopped_stub_has_its_replica_replaced_and_the_set_serves_on(default_engines, tmp_path):
    import re

    from spork_trt.serving.triton_client import ClientConfig, query
    from tests.test_serve_lifecycle import launch_all

    p, guards, ports = launch_all(default_engines, tmp_path, "--replicas", "2", "--stall-timeout", "4",
                                  "--drain-timeout", "5")
    err = tmp_path / "launcher.err"

    def ask() -> str:
        return query("Say hello.", ClientConfig(url=f"127.0.0.1:{ports[1]}", protocol="grpc", stream=True,
                                                max_tokens=8, spec_mode="plain", backoff_s=0.2)).text

    def wait_for(pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, err.read_text()):
            assert time.monotonic() < deadline and p.poll() is None, err.read_text()
            time.sleep(0.2)

    try:
        want = ask()
        tritons = [g for g in guards if any("tritonserver" in c.name() for c in psutil.Process(g).children())]
        stubs = spork_stubs(tritons[0])
        assert len(tritons) == 2 and len(stubs) == 1
        stubs[0].send_signal(signal.SIGSTOP)
        wait_for(r"replica r\d: its engine loop stopped serving \(no heartbeat\): killing it", 30)
        assert ask() == want  # haproxy routes around the replica being replaced
        wait_for(r"replica r\d is serving again", 180)
        assert ask() == want and p.poll() is None
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except Exception:  # noqa: BLE001 - the test's own failure matters more
            p.kill()
