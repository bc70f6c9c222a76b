"""Liveness of the engine loops, judged from outside the processes that run them.

A python model cannot turn Triton's readiness off, and a stub that hangs (a step that never ends, a dead loop
thread, a process stopped by SIGSTOP) would look ready to Triton, to the OpenAI API's /health and to the probes. So
each `spork` instance beats while its loop serves: every half second it touches a file of its own (its pid) in the
folder `serve` names in $SPORK_HEARTBEAT_DIR, and only while `Service.stalled()` finds nothing wrong (the loop
alive, no iteration running past the bound). A stalled loop stops beating and refuses requests at once; a stopped
process stops beating by itself. `serve` reads the folder every half second: a beat older than the bound means an
instance stopped serving. With replicas, the replica holding it is killed and started again (replicas.py; haproxy
routes around it meanwhile); otherwise `serve` stops the server and exits non-zero so that what runs it
(Kubernetes, a supervisor) replaces it.

    stub:  Heartbeat(service, Watch.from_env()).tick()  (from the metrics thread, twice a second)
    serve: wait_serving(alive, Watch(folder, bound_s), replace) -> the instances that stopped beating
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("spork_trt.serving.watchdog")
HEARTBEAT_ENV = "SPORK_HEARTBEAT_DIR"  # set by `serve` for tritonserver and its stubs
BOUND_ENV = "SPORK_STALL_S"  # seconds without a beat (or in one step) after which an instance is dead
DEFAULT_BOUND_S = 30.0


@dataclass(frozen=True)
class Watch:
    folder: Path  # one beat file per instance, named by its pid
    bound_s: float = DEFAULT_BOUND_S

    @classmethod
    def from_env(cls) -> Watch | None:
        """The watch `serve` asked for (None: no watch, e.g. tritonserver started by hand)."""
        folder = os.environ.get(HEARTBEAT_ENV)
        return cls(Path(folder), float(os.environ.get(BOUND_ENV, DEFAULT_BOUND_S))) if folder else None

    def env(self) -> dict[str, str]:
        return {HEARTBEAT_ENV: str(self.folder), BOUND_ENV: f"{self.bound_s:g}"}

    def stale(self, now: float | None = None) -> list[str]:
        """The instances (pids) whose last beat is older than the bound."""
        now = time.time() if now is None else now
        out = []
        for p in self.folder.iterdir() if self.folder.is_dir() else ():
            try:
                if now - p.stat().st_mtime > self.bound_s:
                    out.append(p.name)
            except FileNotFoundError:  # the instance ended and took its file off
                pass
        return sorted(out)


@dataclass
class Heartbeat:
    """One instance's beat: `tick()` touches its file while `service` serves; once it does not, the beat stops for
    good (the instance is to be replaced, not revived)."""

    service: object  # engine_service.Service (stalled(bound_s) -> why | None)
    watch: Watch
    path: Path = field(init=False)
    down: str | None = None

    def __post_init__(self) -> None:
        self.path = self.watch.folder / str(os.getpid())

    def tick(self) -> None:
        if self.down is not None:
            return
        self.down = self.service.stalled(self.watch.bound_s)
        if self.down is not None:
            log.critical("spork: the engine loop stopped serving (%s): no more heartbeats, this server is to be "
                         "replaced", self.down)
            return
        self.path.touch()

    def stop(self) -> None:
        """The instance is unloaded normally: its file goes (a missing file is no stale beat)."""
        self.down = self.down or "unloaded"
        self.path.unlink(missing_ok=True)


def wait_serving(alive, watch: Watch | None, replace=None, period_s: float = 0.5) -> list[str]:
    """Block while `alive()` and every instance beats: [] once `alive()` is false, else the instances (pids) that
    stopped beating and `replace(pids)` (a replica set's: it restarts the replicas holding them) could not take
    care of. Ctrl-C (KeyboardInterrupt) passes through."""
    while alive():
        dead = watch.stale() if watch is not None else []
        if dead and not (replace is not None and replace(dead)):
            return dead
        for pid in dead:  # replaced: the stopped stub cannot take its file off itself
            (watch.folder / pid).unlink(missing_ok=True)
        time.sleep(period_s)
    return []
