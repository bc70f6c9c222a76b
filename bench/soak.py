"""`python -m bench soak`: N clients for a fixed time against one server, a mix of valid, bad and cancelled requests.

Valid requests (greedy, a few prompts and lengths, every protocol) must come back with exactly the text plain
decoding gives alone (computed locally first); bad ones (each kind of invalid field) must be refused with a
message naming the field; cancelled ones (a gRPC stream to the `spork` model, cancelled after its first response)
must free their slot. Counted: lost (no answer, or an answer of the wrong kind), garbled (not valid text, or
U+FFFD), wrong (a different text). The server's resident memory is sampled every few seconds; growth is measured
from the end of warm-up (the first fifth of the run). After the run the slots in use must come back to 0.
"""
from __future__ import annotations

import json
import platform
import queue
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

from spork_trt import atomic
from spork_trt.client import ClientConfig, query
from spork_trt.errors import UserError

from .prompts import git_sha, load_prompts
from .run import command
from .serve import tree_rss_mb

LENGTHS = (8, 24)
PROTOCOLS = (("grpc", True), ("grpc", False), ("http", False), ("generate", False), ("generate", True))
BAD = (({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 2.0}, "top_p"),
       ({"temperature": 1e-38}, "temperature"),  # overflowed to NaN in the step, failing the batch, before the edge
       ({"spec_mode": "warp"}, "spec_mode"), ({"max_tokens": 100_000}, "max_tokens"))


def gauge(metrics_port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def cancelled_stream(server, ids: list[int]) -> bool:
    """A long greedy stream to `spork`, cancelled after its first response; True when that response came."""
    import tritonclient.grpc as grpcclient

    inputs = [grpcclient.InferInput("input_ids", [1, len(ids)], "INT32"),
              grpcclient.InferInput("max_tokens", [1, 1], "INT32"), grpcclient.InferInput("stream", [1, 1], "BOOL")]
    for t, v in zip(inputs, (np.array([ids], np.int32), np.array([[400]], np.int32), np.array([[True]]))):
        t.set_data_from_numpy(v)
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer("spork", inputs)
        result, error = got.get(timeout=600)
        c.stop_stream(cancel_requests=True)
        return error is None
    finally:
        c.close()


class Tally:
    def __init__(self) -> None:
        self.counts = {k: 0 for k in ("valid", "bad", "cancelled", "lost", "garbled", "wrong", "bad_unnamed")}
        self.lock = threading.Lock()
        self.examples: list[str] = []

    def add(self, key: str, example: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if example and len(self.examples) < 20:
                self.examples.append(example)


def client(k: int, server, refs: dict, ids: dict, deadline: float, tally: Tally, mix: tuple[float, float]) -> None:
    rng = random.Random(k)
    prompts = sorted({p for p, _ in refs})
    while time.monotonic() < deadline:
        roll = rng.random()
        prompt = rng.choice(prompts)
        if roll < mix[0]:  # bad input
            over, field = rng.choice(BAD)
            protocol, stream = rng.choice(PROTOCOLS)
            try:
                query(prompt, ClientConfig(url=server.grpc_url if protocol == "grpc" else server.http_url,
                                           protocol=protocol, stream=stream, **{"max_tokens": 8, **over}))
                tally.add("lost", f"bad {over} answered as valid")
            except UserError as e:
                tally.add("bad" if field in str(e) else "bad_unnamed", None if field in str(e) else str(e))
            continue
        if roll < mix[0] + mix[1]:  # cancelled
            try:
                tally.add("cancelled" if cancelled_stream(server, ids[prompt]) else "lost", "cancel: no response")
            except Exception as e:  # noqa: BLE001 - any failure here is a lost request, counted
                tally.add("lost", f"cancel: {e!r}")
            continue
        n = rng.choice(LENGTHS)
        protocol, stream = rng.choice(PROTOCOLS)
        try:
            text = query(prompt, ClientConfig(url=server.grpc_url if protocol == "grpc" else server.http_url,
                                              protocol=protocol, stream=stream, max_tokens=n)).text
        except Exception as e:  # noqa: BLE001 - any failure of a valid request is a lost request, counted
            tally.add("lost", f"{protocol}: {e!r}")
            continue
        if "\ufffd" in text:
            tally.add("garbled", text)
        elif text != refs[prompt, n]:
            tally.add("wrong", f"{protocol} stream={stream}: {text!r} != {refs[prompt, n]!r}")
        else:
            tally.add("valid")


def main(a) -> int:
    from spork_trt.config import GenerateConfig
    from spork_trt.runtime import Runtime
    from spork_trt.serve import ServerConfig, TritonServer, free_port
    from spork_trt.triton_repo import RepoConfig, render

    if a.clients < 1 or a.duration <= 0 or not 0 <= a.bad + a.cancel < 1:
        raise UserError("--clients and --duration must be positive; --bad + --cancel must be in [0, 1)")
    engines = Path(a.engines or "engines/default")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rt = Runtime.from_engines(engines)
    prompts = [r["prompt"] for r in load_prompts(a.prompts, a.limit)]
    print(f"[bench soak] plain greedy references for {len(prompts)} prompts", file=sys.stderr, flush=True)
    ids = {p: rt.tokenizer.encode_prompt(p) for p in prompts}
    refs = {(p, n): rt.generate(ids[p], GenerateConfig(max_new_tokens=n)).text for p in prompts for n in LENGTHS}
    del rt
    repo = render(RepoConfig(engines, out / "repo", slots=a.slots, max_queue=max(64, a.clients)))
    cfg = ServerConfig(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    tally, rss = Tally(), []
    with TritonServer(cfg) as server:
        t0 = time.monotonic()
        deadline = t0 + a.duration
        threads = [threading.Thread(target=client, args=(k, server, refs, ids, deadline, tally, (a.bad, a.cancel)))
                   for k in range(a.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            rss.append((round(time.monotonic() - t0, 1), round(tree_rss_mb(server.proc.pid), 1),
                        gauge(cfg.metrics_port, "spork_active_requests")))
            print(f"[bench soak] {rss[-1][0]:.0f}s: {tally.counts} rss {rss[-1][1]:.0f} MB", file=sys.stderr,
                  flush=True)
            time.sleep(a.sample_s)
        for t in threads:
            t.join()
        settle = time.monotonic() + 30
        while (slots := gauge(cfg.metrics_port, "spork_active_requests")) and time.monotonic() < settle:
            time.sleep(0.5)  # the metrics gauge is published twice a second
    warm = next((r for t, r, _ in rss if t >= a.duration / 5), rss[0][1])
    summary = {"git_sha": git_sha(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
               "clients": a.clients, "duration_s": a.duration, "slots": a.slots, "mix": {"bad": a.bad,
               "cancel": a.cancel}, "counts": tally.counts, "examples": tally.examples,
               "slots_in_use_after": slots, "rss_after_warmup_mb": warm, "rss_end_mb": rss[-1][1],
               "rss_growth_after_warmup": round(rss[-1][1] / warm - 1, 4), "rss_samples": rss,
               "command": command()}
    atomic.write_text(out / "soak.json", json.dumps(summary, indent=1))
    plot(rss, out / "soak_rss.png")
    c = tally.counts
    print(json.dumps(summary) if a.json else
          f"{c['valid']} valid, {c['bad']} bad refused naming the field, {c['cancelled']} cancelled; lost "
          f"{c['lost']}, garbled {c['garbled']}, wrong {c['wrong']}, bad without the field named "
          f"{c['bad_unnamed']}; slots in use after: {slots:.0f}; RSS {warm:.0f} -> {rss[-1][1]:.0f} MB "
          f"({summary['rss_growth_after_warmup']:+.1%} after warm-up)")
    ok = not (c["lost"] or c["garbled"] or c["wrong"] or c["bad_unnamed"] or slots)
    return 0 if ok else 1


def plot(rss: list, path: Path) -> None:
    from .report import finish, plt

    p = plt()
    fig, ax = p.subplots(figsize=(6, 3.5))
    ax.plot([t for t, _, _ in rss], [r for _, r, _ in rss], "o-", label="server RSS (MB)")
    ax2 = ax.twinx()
    ax2.plot([t for t, _, _ in rss], [s for _, _, s in rss], "s--", color="gray", label="requests holding a slot")
    ax.set(xlabel="seconds", ylabel="resident memory (MB)")
    ax2.set(ylabel="active requests")
    finish(fig, [ax], path)
