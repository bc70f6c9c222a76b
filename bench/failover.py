"""`python -m bench failover`: two replicas behind haproxy (`serve --replicas 2`) under N clients; mid-run one replica
is drained (SIGTERM), then, on a fresh pair, one is killed (SIGKILL).

Every client sends greedy requests in a loop (gRPC streaming, HTTP infer, HTTP generate_stream in turn; a few
prompts, 16 and --max-new-tokens new tokens) with the client's retries (a request with no answer yet is sent
again); every answer is checked against the text plain greedy decoding gives alone (computed locally first).
Counted per phase: ok, wrong (another text), cut (an answer cut after its first response, which the client reports
as incomplete), lost (no answer after the retries, or an error), and the retries the clients made. Goals
(operations issue): drained, 0 errors; killed, 0 lost, cut streams counted.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path

from spork_trt import atomic
from spork_trt.serving.triton_client import ClientConfig, query
from spork_trt.errors import UserError

from .prompts import git_sha, load_prompts
from .run import command

PROTOCOLS = (("grpc", True), ("http", False), ("generate", True))
PHASES = {"drain": signal.SIGTERM, "kill": signal.SIGKILL}  # what the replica gets mid-run


class Count:
    def __init__(self) -> None:
        self.counts = {k: 0 for k in ("ok", "wrong", "cut", "lost", "retries")}
        self.lock, self.examples = threading.Lock(), []

    def add(self, key: str, n: int = 1, example: str | None = None) -> None:
        with self.lock:
            self.counts[key] += n
            if example and len(self.examples) < 10:
                self.examples.append(example)


def client(k: int, rs, refs: dict, deadline: float, count: Count) -> None:
    for i in range(10 ** 9):
        if time.monotonic() >= deadline:
            return
        (prompt, n), (protocol, stream) = list(refs)[(k + i) % len(refs)], PROTOCOLS[(k + i) % len(PROTOCOLS)]
        cfg = ClientConfig(url=rs.grpc_url if protocol == "grpc" else rs.http_url, protocol=protocol, stream=stream,
                           max_tokens=n, spec_mode="plain")
        try:
            reply = query(prompt, cfg)
        except UserError as e:
            count.add("cut" if "incomplete" in str(e) else "lost", example=f"{protocol}: {e}")
            continue
        count.add("retries", reply.retries)
        count.add("ok" if reply.text == refs[prompt, n] else "wrong", example=None if reply.text == refs[prompt, n]
                  else f"{protocol}: {reply.text!r} != {refs[prompt, n]!r}")


def phase(name: str, a, repo: Path, refs: dict, out: Path) -> dict:
    from spork_trt.serving.replicas import ReplicaSet
    from spork_trt.serving.triton_server import ServerConfig, free_port

    cfg = ServerConfig(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       log_file=out / name / "tritonserver.log", drain_timeout_s=a.drain_timeout)
    count = Count()
    print(f"[bench failover] {name}: starting two replicas behind haproxy", file=sys.stderr, flush=True)
    with ReplicaSet(cfg, 2) as rs:
        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(k, rs, refs, t0 + a.duration, count))
                   for k in range(a.clients)]
        for t in threads:
            t.start()
        time.sleep(a.duration / 3)
        victim = rs.servers[0].proc.pid  # its guard: SIGTERM drains tritonserver; SIGKILL takes its whole group
        (os.kill if PHASES[name] == signal.SIGTERM else os.killpg)(victim, PHASES[name])
        at = round(time.monotonic() - t0, 1)
        print(f"[bench failover] {name}: {PHASES[name].name} to replica 0 at {at}s", file=sys.stderr, flush=True)
        for t in threads:
            t.join()
    c = count.counts
    print(f"[bench failover] {name}: {c}", file=sys.stderr, flush=True)
    return {"phase": name, "signal": PHASES[name].name, "at_s": at, **c, "examples": count.examples}


def main(a) -> int:
    from spork_trt.config import GenerateConfig
    from spork_trt.config import AUTO_DTYPE
    from spork_trt.loop.runtime import Runtime
    from spork_trt.serving.triton_repo import RepoConfig, render

    if a.clients < 1 or a.duration <= 0:
        raise UserError("--clients and --duration must be positive")
    engines, out = Path(a.engines or "engines/default"), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rt = Runtime.from_engines(engines, dtype=AUTO_DTYPE)
    prompts = [r["prompt"] for r in load_prompts(a.prompts, a.limit)]
    print(f"[bench failover] plain greedy references for {len(prompts)} prompts", file=sys.stderr, flush=True)
    refs = {(p, n): rt.generate(rt.tokenizer.encode_prompt(p), GenerateConfig(max_new_tokens=n)).text
            for p in prompts for n in sorted({16, a.max_new_tokens})}
    del rt
    repo = render(RepoConfig(engines, out / "repo", slots=a.slots, max_queue=max(64, a.clients)))
    rows = [phase(name, a, repo, refs, out) for name in PHASES]
    summary = {"git_sha": git_sha(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
               "clients": a.clients, "duration_s": a.duration, "slots": a.slots, "phases": rows, "command": command()}
    atomic.write_text(out / "failover.json", json.dumps(summary, indent=1))
    print(json.dumps(summary) if a.json else "\n".join(
        f"{r['phase']} ({r['signal']} at {r['at_s']}s): {r['ok']} ok, {r['wrong']} wrong, {r['cut']} cut, "
        f"{r['lost']} lost, {r['retries']} retries" for r in rows))
    drain, kill = rows
    ok = not (drain["wrong"] or drain["cut"] or drain["lost"] or kill["wrong"] or kill["lost"])
    return 0 if ok else 1
