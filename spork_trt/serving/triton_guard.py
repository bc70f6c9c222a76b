"""The guard between `serve` and tritonserver: nothing of the server outlives its launcher.

    launcher --pipe--> guard (own session, leader of the server's process group) --> tritonserver --> stubs

The launcher holds the write end of the guard's stdin. However the launcher ends (return, exception, a second
Ctrl-C during stop, SIGHUP, SIGKILL, an OOM kill), the kernel closes that pipe, the guard reads EOF and takes the
group down: SIGTERM to tritonserver (it drains and unloads), SIGKILL to the whole group after the grace period.
SIGTERM, SIGINT or SIGHUP sent to the guard itself are passed to tritonserver as SIGTERM (a drain). tritonserver
gets a parent-death signal (SIGKILL), so even a killed guard does not leave it running. When tritonserver exits,
whatever else is left in the group (python backend stubs stopped while loading survive SIGTERM) is killed and the
guard exits with tritonserver's code.

    python -m spork_trt.serving.triton_guard GRACE_S    (stdin: the command as one JSON line, then held open)

The command comes through the pipe, not the guard's argv: it holds the admin key (triton_server.command), which
any local user could read in /proc/PID/cmdline. (tritonserver's own argv still holds it: Triton takes the
restricted-API key only on its command line.)
"""
from __future__ import annotations

import ctypes
import json
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
        while os.read(0, 4096):  # the launcher writes nothing after the command: only EOF (its end closed) comes back
            pass
        self.drain()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.drain)
        threading.Thread(target=self.watch_launcher, daemon=True).start()
        code = self.server.wait()
        kill_others()
        return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says


def guarded(cmd: list[str], grace_s: float, **popen) -> subprocess.Popen:
    """Start `cmd` under a guard (in a session of its own, its stdin a pipe only this process holds): the guard's
    process. `popen`: Popen's other arguments (env, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "spork_trt.serving.triton_guard", str(grace_s)],
                            stdin=subprocess.PIPE, start_new_session=True, **popen)
    proc.stdin.write(json.dumps(cmd).encode() + b"\n")
    proc.stdin.flush()
    return proc


def read_command(fd: int = 0) -> list[str] | None:
    """The first line of `fd`, a JSON list of strings, read byte by byte (nothing past it is consumed); None if
    the pipe closed first or the line is not one."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            return None
        line += byte
    try:
        cmd = json.loads(line)
    except ValueError:
        return None
    return cmd if isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd) else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = read_command() if len(argv) == 1 else None
    if cmd is None:
        print("usage: python -m spork_trt.serving.triton_guard GRACE_S  (stdin: the command as a JSON list, one "
              "line, then held open)", file=sys.stderr)
        return 2
    return Guard(cmd, float(argv[0])).run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: the thread blocked reading stdin must not hold up the interpreter's shutdown
