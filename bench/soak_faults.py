"""`python -m bench soak --faults`: the soak against a whole deployment while it is hurt.

`serve --replicas 2` (haproxy in front, the OpenAI API beside it, the watchdog at --stall-timeout) runs in a process
of its own, its stderr in OUT/serve.log. Two thirds of the clients are soak.py's Triton clients (through haproxy,
with the client's retries); the rest speak the OpenAI API: greedy chat completions (streamed or not, through the
`openai` client with its retries) checked against plain decoding, and bad bodies of every kind the network-safety
issue names (a list as a role, lone UTF-16 surrogates, a 5,000-digit integer, 50,000 nested brackets, values past
int32 / float32, an unknown field, a wrong Content-Type, a body one byte past the limit, and a maximal body: 4,096
messages of 900 characters), each of which must be a 4xx in OpenAI's shape naming its field.

Faults, one each: at a quarter of the run the `spork` stub of replica r0 is stopped with SIGSTOP for --pause
seconds (the watchdog must kill and restart the replica; its Triton readiness is sampled meanwhile), at 55% replica
r1's process group is killed with SIGKILL (the replica set restarts it). A request cut under a fault (a stream that
had begun, or a connection the fault closed) is counted `cut` with its time; it must fall inside a fault's window
(the fault until its replica serves again). Each fault must be named in serve.log.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from spork_trt.serving.openai_api.messages import MAX_MESSAGES
from spork_trt.serving.openai_api.server import FrontConfig

from .soak import cut

LOG_NAMES = {"stall": r"replica r0: its engine loop stopped serving", "kill": r"replica r1 exited \(code",
             "back": r"replica r\d is serving again"}  # what serve.log must say about each fault
LIMIT = FrontConfig.max_body_bytes


@dataclass(frozen=True)
class Deployment:
    """The `serve` process and what its ready line says."""
    proc: subprocess.Popen
    http_url: str  # haproxy's (host:port)
    grpc_url: str
    openai_url: str  # http://host:port/v1
    model: str
    replica_http: tuple[str, ...]  # each replica's own Triton HTTP (host:port), r0 first
    replica_metrics: tuple[str, ...]
    log: Path


def launch(repo: Path, out: Path, stall_s: float, ports: list[int]) -> Deployment:
    log = out / "serve.log"
    err = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "spork_trt", "serve", "--repo", str(repo), "--replicas", "2",
                             "--stall-timeout", str(stall_s), "--http-port", str(ports[0]), "--grpc-port",
                             str(ports[1]), "--metrics-port", str(ports[2]), "--openai-port", str(ports[3]),
                             "--log", str(out / "triton.log")], stderr=err, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (ready := [line for line in log.read_text().splitlines() if line.startswith("ready:")]):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"serve did not start; {log}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    line = ready[0]
    http, grpc = re.search(r"HTTP (\S+)  gRPC (\S+)", line).groups()
    replicas = re.findall(r"r\d: HTTP (\S+), metrics (\S+?)[;)]", line)
    openai = re.search(r"OpenAI API (\S+) \(model (.+?), ", line).groups()
    return Deployment(proc, http, grpc, openai[0], openai[1], tuple(h for h, _ in replicas),
                      tuple(m for _, m in replicas), log)


def replica_group(dep: Deployment, i: int) -> int | None:
    """The process group of replica i (its guard leads one): found by the tritonserver in it that serves its port."""
    port = dep.replica_http[i].rsplit(":", 1)[1]
    for q in psutil.Process(dep.proc.pid).children(recursive=True):
        try:
            if q.name().startswith("tritonserver") and f"--http-port={port}" in q.cmdline():
                return os.getpgid(q.pid)
        except (psutil.Error, ProcessLookupError):
            pass
    return None


def spork_stubs(group: int) -> list[psutil.Process]:
    """The `spork` model's Python backend stubs in a process group (a tritonserver's)."""
    out = []
    for q in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(q.pid) == group and "/spork/" in " ".join(q.cmdline()):
                out.append(q)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def is_ready(host_port: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host_port}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def wait_back(dep: Deployment, at: float, timeout_s: float = 600) -> float | None:
    """Seconds after `at` (monotonic) until serve.log says a replica serves again after that point."""
    seen = len(re.findall(LOG_NAMES["back"], dep.log.read_text()))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(re.findall(LOG_NAMES["back"], dep.log.read_text())) > seen:
            return round(time.monotonic() - at, 1)
        time.sleep(0.5)
    return None


def make_faults(dep: Deployment, t0: float, duration: float, pause_s: float, record: dict) -> None:
    """SIGSTOP replica r0's spork stub at 25% of the run for pause_s (readiness sampled), SIGKILL r1 at 55%."""
    time.sleep(max(0.0, t0 + 0.25 * duration - time.monotonic()))
    group = replica_group(dep, 0)
    stub = next(iter(spork_stubs(group)), None) if group else None
    if stub is None:
        record["stall"] = {"error": "no spork stub found in replica r0"}
    else:
        stub.send_signal(signal.SIGSTOP)
        at = time.monotonic()
        ready = []  # (seconds after the stop, r0 ready)
        while time.monotonic() < at + pause_s:
            ready.append((round(time.monotonic() - at, 1), is_ready(dep.replica_http[0])))
            time.sleep(0.5)
        try:
            stub.send_signal(signal.SIGCONT)  # a no-op when the watchdog has already killed its replica
        except psutil.Error:
            pass
        back = wait_back(dep, at) if not any(r for _, r in ready[len(ready) // 2:]) else None
        record["stall"] = {"at_s": round(at - t0, 1), "pid": stub.pid, "pause_s": pause_s,
                           "not_ready_after_s": next((t for t, r in ready if not r), None),
                           "ready_samples": ready, "serving_again_after_s": back}
    time.sleep(max(0.0, t0 + 0.55 * duration - time.monotonic()))
    group = replica_group(dep, 1)
    if group is None:
        record["kill"] = {"error": "replica r1 not found"}
        return
    os.killpg(group, signal.SIGKILL)
    at = time.monotonic()
    record["kill"] = {"at_s": round(at - t0, 1), "group": group, "serving_again_after_s": wait_back(dep, at)}


def bad_bodies(model: str) -> list[tuple[str, str, bytes, str, str]]:
    """(what, route, body, content type, the field the refusal must name): each one a 4xx in OpenAI's shape."""
    def j(route: str, what: str, fields: dict, needle: str, ctype: str = "application/json"):
        return what, route, json.dumps({"model": model, **fields}).encode(), ctype, needle

    hi = [{"role": "user", "content": "hi"}]
    return [
        j("chat", "a list as a role", {"messages": [{"role": ["user"], "content": "hi"}]}, "role"),
        j("chat", "a lone surrogate in content", {"messages": [{"role": "user", "content": "a \ud800 b"}]},
          "content"),
        j("completions", "a lone surrogate in stop", {"prompt": "hi", "stop": ["\udfff"]}, "stop"),
        ("a 5,000-digit integer", "completions",
         b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (model.encode(), b"9" * 5000), "application/json",
         "JSON"),
        ("50,000 nested brackets", "chat", b"[" * 50000 + b"]" * 50000, "application/json", "nests"),
        j("completions", "top_k past int64", {"prompt": "hi", "top_k": 2**63}, "top_k"),
        j("completions", "top_k past int32", {"prompt": "hi", "top_k": 2**32 + 1}, "top_k"),
        j("chat", "temperature past float32", {"messages": hi, "temperature": 1e39}, "temperature"),
        j("chat", "n past its range", {"messages": hi, "n": 17}, "n"),
        j("chat", "an unknown field", {"messages": hi, "bogus": 1}, "bogus"),
        j("chat", "no messages", {}, "messages"),
        j("chat", "a text/plain body", {"messages": hi}, "Content-Type", "text/plain"),
        j("completions", "a body one byte past the limit", {"prompt": "x" * LIMIT}, "request_too_large"),
        j("chat", "a maximal body", {"messages": [{"role": "user", "content": "x" * 900}] * MAX_MESSAGES},
          "context_length_exceeded"),
    ]


def post(openai_url: str, route: str, body: bytes, ctype: str) -> tuple[int, dict | None]:
    req = urllib.request.Request(f"{openai_url}/{route.replace('chat', 'chat/completions')}", data=body,
                                 headers={"Content-Type": ctype}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError as e:  # a reset connection: no answer at all
        return 0, {"error": repr(e)}
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


def named(err: dict | None, needle: str) -> bool:
    """An error in OpenAI's shape that names `needle` in its param, code or message."""
    e = (err or {}).get("error")
    return isinstance(e, dict) and {"message", "type"} <= set(e) and any(
        needle in str(e.get(k) or "") for k in ("param", "code", "message"))


def openai_client(k: int, dep: Deployment, refs: dict, deadline: float, tally, bad_share: float,
                  cuts: list) -> None:
    """Greedy chat completions (streamed or not) checked against plain decoding, and bad bodies."""
    import openai

    rng = random.Random(1000 + k)
    c = openai.OpenAI(base_url=dep.openai_url, api_key="none", max_retries=4, timeout=300)
    prompts = sorted({p for p, *_ in refs})
    bad = bad_bodies(dep.model)
    while time.monotonic() < deadline:
        if rng.random() < bad_share:
            what, route, body, ctype, needle = rng.choice(bad)
            status, err = post(dep.openai_url, route, body, ctype)
            if status < 400 or status >= 500:
                tally.add("lost", f"openai bad ({what}): {status} {str(err)[:200]}")
            else:
                tally.add("bad" if named(err, needle) else "bad_unnamed",
                          None if named(err, needle) else f"openai bad ({what}): {status} {str(err)[:300]}")
            continue
        prompt, n, stream = rng.choice(prompts), rng.choice((8, 24)), rng.random() < 0.5
        try:
            r = c.chat.completions.create(model=dep.model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=n, temperature=0, stream=stream)
            text = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream else \
                r.choices[0].message.content
        except openai.APIStatusError as e:
            if e.status_code == 503:
                tally.add("refused")
            else:
                tally.add("lost", f"openai stream={stream}: {e.status_code} {str(e)[:300]}")
            continue
        except Exception as e:  # noqa: BLE001 - a stream the fault cut, or a lost request: told apart below
            cut(tally, cuts, f"openai stream={stream}: {e!r}")
            continue
        want = refs[prompt, n, None]
        if "\ufffd" in text:
            tally.add("garbled", text)
        elif text != want:
            tally.add("wrong", f"openai stream={stream}: {text!r} != {want!r}")
        else:
            tally.add("valid")


def windows(record: dict, t0: float) -> list[tuple[float, float]]:
    """Each fault's window in monotonic seconds: from the fault until its replica served again (plus 10 s for
    answers in flight), or to the end of time when it never did."""
    out = []
    for name in ("stall", "kill"):
        f = record.get(name, {})
        if "at_s" in f:
            back = f.get("serving_again_after_s")
            out.append((t0 + f["at_s"], t0 + f["at_s"] + (back + 10 if back is not None else 1e9)))
    return out


def verdict(record: dict, log_text: str, cuts: list, t0: float) -> dict:
    """What the faults showed: each named in serve.log, readiness false while r0's engine was stopped, cuts only
    inside the faults' windows."""
    spans = windows(record, t0)
    stall = record.get("stall", {})
    return {"named_in_log": {k: bool(re.search(p, log_text)) for k, p in LOG_NAMES.items()},
            "not_ready_while_stopped": stall.get("not_ready_after_s") is not None,
            "cuts_outside_fault_windows": sum(not any(a <= t <= b for a, b in spans) for t in cuts)}


def run(a, repo: Path, refs: dict, ids: dict, mix: tuple[float, ...], queue_cap: int) -> int:
    """The soak with faults (the module's doc): the counts, the faults' record and verdict in OUT/soak_faults.json;
    0 when nothing was lost, garbled or wrong, every bad input was named, each fault was named in serve.log, r0 was
    not ready while its engine was stopped, every cut fell in a fault's window and serve stopped cleanly."""
    from spork_trt import atomic
    from spork_trt.serving.triton_server import free_port

    from .prompts import git_sha
    from .run import command
    from .serve import tree_rss_mb
    from .soak import Tally, client, gauge

    out = Path(a.out)
    dep = launch(repo, out, a.stall_timeout, [free_port() for _ in range(4)])
    tally, rss, cuts, record = Tally(), [], [], {}
    try:
        t0 = time.monotonic()
        deadline = t0 + a.duration
        n_openai = max(1, a.clients // 3)
        threads = [threading.Thread(target=client, args=(k, dep, refs, ids, deadline, tally, mix, cuts))
                   for k in range(a.clients - n_openai)]
        threads += [threading.Thread(target=openai_client, args=(k, dep, refs, deadline, tally, mix[0], cuts))
                    for k in range(n_openai)]
        faults = threading.Thread(target=make_faults, args=(dep, t0, a.duration, a.pause, record))
        for t in (*threads, faults):
            t.start()
        while any(t.is_alive() for t in threads):
            rss.append((round(time.monotonic() - t0, 1), round(tree_rss_mb(dep.proc.pid), 1)))
            print(f"[bench soak] {rss[-1][0]:.0f}s: {tally.counts} rss {rss[-1][1]:.0f} MB", file=sys.stderr,
                  flush=True)
            time.sleep(a.sample_s)
        faults.join()
        settle = time.monotonic() + 30
        while (slots := sum(gauge(int(m.rsplit(":", 1)[1]), "spork_active_requests") for m in dep.replica_metrics)) \
                and time.monotonic() < settle:
            time.sleep(0.5)
    finally:
        dep.proc.send_signal(signal.SIGTERM)
        try:
            stop_code = dep.proc.wait(120)
        except subprocess.TimeoutExpired:
            dep.proc.kill()
            stop_code = None
    log_text = dep.log.read_text()
    seen = verdict(record, log_text, cuts, t0)
    warm = next((r for t, r in rss if t >= a.duration / 5), rss[0][1])
    summary = {"git_sha": git_sha(), "clients": a.clients, "openai_clients": n_openai, "duration_s": a.duration,
               "slots": a.slots, "max_queue": queue_cap, "stall_timeout_s": a.stall_timeout,
               "mix": dict(zip(("bad", "cancel", "deadline", "sampled"), mix)), "counts": tally.counts,
               "faults": record, "verdict": seen, "examples": tally.examples, "slots_in_use_after": slots,
               "rss_after_warmup_mb": warm, "rss_end_mb": rss[-1][1],
               "rss_growth_after_warmup": round(rss[-1][1] / warm - 1, 4), "rss_samples": rss,
               "stop_exit_code": stop_code, "command": command()}
    atomic.write_text(out / "soak_faults.json", json.dumps(summary, indent=1))
    print(json.dumps(summary) if a.json else
          f"{tally.line()} ({seen['cuts_outside_fault_windows']} cut outside a fault's window); faults named in "
          f"serve.log: {seen['named_in_log']}; r0 not ready {record.get('stall', {}).get('not_ready_after_s')} s "
          f"after its stop; RSS {warm:.0f} -> {rss[-1][1]:.0f} MB ({summary['rss_growth_after_warmup']:+.1%}); "
          f"serve exited with {stop_code}")
    ok = not (tally.failed() or slots or stop_code or seen["cuts_outside_fault_windows"]
              or not all(seen["named_in_log"].values()) or not seen["not_ready_while_stopped"])
    return 0 if ok else 1
