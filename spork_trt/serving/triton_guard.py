"""The guard between `serve` and tritonserver: nothing of the server outlives its launcher.

    launcher --pipe--> guard (own session, leader of the server's process group) --> tritonserver --> stubs

The launcher holds the write end of the guard's stdin. However the launcher ends (return, exception, a second
Ctrl-C during stop, SIGHUP, SIGKILL, an OOM kill), the kernel closes that pipe, the guard reads EOF and takes the
group down: SIGTERM to tritonserver (it drains and unloads), SIGKILL to the whole group after the grace period.
SIGTERM, SIGINT or SIGHUP sent to the guard itself are passed to tritonserver as SIGTERM (a drain). tritonserver
gets a parent-death signal (SIGKILL), so even a killed guard does not leave it running. When tritonserver exits,
whatever else is left in the group (python backend stubs stopped while loading survive SIGTERM) is killed and the
guard exits with tritonserver's code.

    python -m spork_trt.serving.triton_guard GRACE_S -- tritonserver ARGS...
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent (the guard) dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def others_in_group() -> list[int]:
    """Every live process of this process group but the guard itself."""
    import psutil

    me, group = os.getpid(), os.getpgrp()
    pids = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != me and os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return pids


def kill_others(timeout_s: float = 10.0) -> None:
    """SIGKILL every other process of the group, and wait (bounded) until none is left."""
    deadline = time.monotonic() + timeout_s
    while (pids := others_in_group()) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


class Guard:
    def __init__(self, cmd: list[str], grace_s: float) -> None:
        self.grace_s = grace_s
        self.server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self.stopping = threading.Event()

    def drain(self, *_) -> None:
        """SIGTERM to tritonserver once; SIGKILL to the group if it is not gone after the grace period."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        try:
            self.server.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        timer = threading.Timer(self.grace_s, kill_others)
        timer.daemon = True
        timer.start()

    def watch_launcher(self) -> None:
        while os.read(0, 4096):  # the launcher never writes: only EOF (its end closed) comes back
            pass
        self.drain()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.drain)
        threading.Thread(target=self.watch_launcher, daemon=True).start()
        code = self.server.wait()
        kill_others()
        return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m spork_trt.serving.triton_guard GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    return Guard(argv[2:], float(argv[0])).run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: the thread blocked reading stdin must not hold up the interpreter's shutdown
