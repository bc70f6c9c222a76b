"""`python -m bench soak`: N clients for a fixed time against one server, a mix of valid, bad, cancelled and deadline
requests, with enough load to fill the queue.

Valid requests (greedy, or seeded sampling in plain mode; a few prompts and lengths; every protocol) must come back
with exactly the text the same request gives alone (plain decoding, computed locally first), or be refused as
unavailable when every slot and the queue are full (counted: refused; the clients do not retry here); bad ones
(each kind of invalid field or tensor: tiny, huge and NaN temperatures, ids outside the vocabulary sent to the
`spork` model, wrong shapes and dtypes, unknown inputs, text too large to tokenize) must be refused with a message
naming it; cancelled ones (a gRPC stream to the `spork` model, cancelled after its first response) must free their
slot; deadline ones (a long greedy request with a deadline of a fraction of a second) must end with stop reason
`timeout` (or finish first) and a prefix of the plain text. Counted: lost (no answer, or an answer of the wrong
kind), garbled (not valid text, or U+FFFD), wrong (a different text). The server's resident memory is sampled
every few seconds; growth is measured from the end of warm-up (the first fifth of the run). After the run the
slots in use must come back to 0.
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
from spork_trt.serving.triton_client import ClientConfig, query
from spork_trt.errors import UserError, retryable

from .prompts import git_sha, load_prompts
from .run import command
from .serve import tree_rss_mb

LENGTHS = (8, 24)
PROTOCOLS = (("grpc", True), ("grpc", False), ("http", False), ("generate", False), ("generate", True))
SAMPLED = dict(temperature=0.8, top_p=0.95)  # the sampled requests' settings (each with a seed of SEEDS)
SEEDS = (1, 2)
DEADLINE = (0.3, 200)  # a deadline request: seconds, max_tokens
BAD = (({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 2.0}, "top_p"),
       ({"temperature": 1e-38}, "temperature"),  # overflowed to NaN in the step, failing the batch, before the edge
       ({"temperature": float("nan")}, "temperature"), ({"temperature": 1e39}, "temperature"),  # inf in fp32
       ({"top_k": -1}, "top_k"), ({"deadline_s": -1.0}, "timeout_s"),
       ({"spec_mode": "warp"}, "spec_mode"), ({"max_tokens": 100_000}, "max_tokens"))
TEXT = (np.array([[b"hi"]], np.object_), "BYTES")
# tensors no client config can express, sent to ensemble_unary (or `spork` for input_ids): (inputs, the name the
# refusal must carry)
CUT_HINTS = ("incomplete", "Socket closed", "Connection reset", "Broken pipe", "RST_STREAM", "failed to connect",
             "Connection refused", "Server disconnected", "peer closed", "EOF", "Connection aborted", "retry later")  # a
# request's error that says a fault closed its connection or stream (soak_faults.py), not that it was lost
RAW_BAD = (({"text_input": TEXT, "bogus": (np.array([[1]], np.int32), "INT32")}, "bogus"),
           ({"text_input": TEXT, "max_tokens": (np.array([[8, 9]], np.int32), "INT32")}, "max_tokens"),
           ({"text_input": TEXT, "max_tokens": (np.array([[8.0]], np.float32), "FP32")}, "max_tokens"),
           ({"text_input": (np.array([[b"a" * (2 << 20)]], np.object_), "BYTES")}, "text_input"),
           ({"input_ids": (np.array([[10 ** 9]], np.int32), "INT32")}, "input_ids"),
           ({"input_ids": (np.array([[-5]], np.int32), "INT32")}, "input_ids"))


def cut(tally, cuts: list, message: str) -> None:
    """A request that failed: cut by a fault when its error says a connection or stream went away (its time kept,
    checked against the faults' windows afterwards), else lost."""
    if any(h in message for h in CUT_HINTS):
        tally.add("cut", message[:300])
        cuts.append(time.monotonic())
    else:
        tally.add("lost", message[:300])



def gauge(metrics_port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def cancelled_stream(server, ids: list[int]) -> str | None:
    """A long greedy stream to `spork`, cancelled after its first response; None when that response came, else the
    error it got instead."""
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
        c.stop_stream(cancel_requests=error is None)  # a refused request is over: cancelling it would leave it held
        # by Triton 2.51 (docs/serving.md, known issues)
        return None if error is None else error.message()
    finally:
        c.close()


def raw_infer(server, inputs: dict) -> str:
    """tritonclient HTTP infer with hand-made tensors (to `spork_unary` when they hold input_ids, else
    `ensemble_unary`); the refusal's message, '' when answered."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with httpclient.InferenceServerClient(server.http_url) as c:
        tensors = []
        for name, (arr, dtype) in inputs.items():
            tensors.append(httpclient.InferInput(name, list(arr.shape), dtype))
            tensors[-1].set_data_from_numpy(arr)
        try:
            c.infer("spork_unary" if "input_ids" in inputs else "ensemble_unary", tensors)
            return ""
        except InferenceServerException as e:
            return e.message()


class Tally:
    def __init__(self) -> None:
        self.counts = {k: 0 for k in ("valid", "sampled", "deadline", "refused", "bad", "cancelled", "lost", "garbled",
                                      "wrong", "bad_unnamed", "cut")}
        self.lock = threading.Lock()
        self.examples: list[str] = []

    def line(self) -> str:
        """The counts in words, for the summary line."""
        c = self.counts
        return (f"{c['valid']} greedy, {c['sampled']} sampled and {c['deadline']} deadline requests right, "
                f"{c['refused']} refused as unavailable, {c['bad']} bad refused naming the field, {c['cancelled']} "
                f"cancelled, {c['cut']} cut by a fault; lost {c['lost']}, garbled {c['garbled']}, wrong "
                f"{c['wrong']}, bad without the field named {c['bad_unnamed']}")

    def failed(self) -> bool:
        """Something lost, garbled, wrong or refused without its field named."""
        return any(self.counts[k] for k in ("lost", "garbled", "wrong", "bad_unnamed"))

    def add(self, key: str, example: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if example and len(self.examples) < 20:
                self.examples.append(f"{time.strftime('%H:%M:%S')} {example}")  # the server log's clock (UTC here)


def refusal(tally: Tally) -> None:
    """A request refused as unavailable (every slot and the queue full): counted, then a pause before the next, as a
    client backing off would."""
    tally.add("refused")
    time.sleep(0.05)


def client(k: int, server, refs: dict, ids: dict, deadline: float, tally: Tally, mix: tuple[float, ...],
           cuts: list | None = None) -> None:
    """Requests in a loop until `deadline`, each kind drawn by `mix` (bad, cancelled, deadline, sampled shares; the
    rest greedy). With `cuts` (a run with faults, soak_faults.py), valid requests get the client's retries and a
    failure a fault explains is counted cut (`cut`), its time appended to `cuts`."""
    rng = random.Random(k)
    retries = 0 if cuts is None else ClientConfig.retries

    def failed(message: str) -> None:
        if cuts is None:
            tally.add("lost", message)
        else:
            cut(tally, cuts, message)

    prompts = sorted({p for p, *_ in refs})
    while time.monotonic() < deadline:
        roll, prompt = rng.random(), rng.choice(prompts)
        protocol, stream = rng.choice(PROTOCOLS)
        url = server.grpc_url if protocol == "grpc" else server.http_url
        if roll < mix[0]:  # bad input
            if rng.random() < 0.5:
                inputs, field = rng.choice(RAW_BAD)
                message = raw_infer(server, inputs)
            else:
                over, field = rng.choice(BAD)
                try:
                    query(prompt, ClientConfig(url=url, protocol=protocol, stream=stream, retries=0,
                                               **{"max_tokens": 8, **over}))
                    message = ""
                except UserError as e:
                    message = str(e)
            if not message:
                tally.add("lost", f"bad {field} answered as valid")
            elif cuts is not None and any(h in message for h in CUT_HINTS):
                failed(f"bad {field}: {message}")
            elif retryable(message):  # refused before it was read: the queue in front of it was full
                refusal(tally)
            else:
                tally.add("bad" if field in message else "bad_unnamed", None if field in message else message)
            continue
        if roll < mix[0] + mix[1]:  # cancelled
            try:
                error = cancelled_stream(server, ids[prompt])
            except Exception as e:  # noqa: BLE001 - any failure here is a lost request, counted
                error = repr(e)
            if error and retryable(error):
                refusal(tally)
            elif error:
                failed(f"cancel: {error}")
            else:
                tally.add("cancelled")
            continue
        kind, n, seed, over = "valid", rng.choice(LENGTHS), None, {}
        if roll < sum(mix[:3]):
            kind, n, over = "deadline", DEADLINE[1], {"deadline_s": DEADLINE[0]}
        elif roll < sum(mix[:4]):
            kind, seed, over = "sampled", rng.choice(SEEDS), {**SAMPLED, "spec_mode": "plain"}
        try:
            reply = query(prompt, ClientConfig(url=url, protocol=protocol, stream=stream, max_tokens=n,
                                               retries=retries, seed=seed, **over))
        except UserError as e:
            if retryable(str(e)):
                refusal(tally)
            else:
                failed(f"{kind} {protocol} stream={stream}: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - any failure of a valid request is a lost request, counted
            failed(f"{kind} {protocol} stream={stream}: {e!r}")
            continue
        want = refs[prompt, n, seed]
        if "\ufffd" in reply.text:
            tally.add("garbled", reply.text)
        elif reply.text != want and not (kind == "deadline" and reply.stop_reason == "timeout"
                                          and want.startswith(reply.text)):
            tally.add("wrong", f"{kind} {protocol} stream={stream}: {reply.text!r} != {want!r}")
        else:
            tally.add(kind)


def main(a) -> int:
    from spork_trt.config import GenerateConfig, SamplingConfig
    from spork_trt.config import AUTO_DTYPE
    from spork_trt.loop.runtime import Runtime
    from spork_trt.serving.triton_server import ServerConfig, TritonServer, free_port
    from spork_trt.serving.triton_repo import RepoConfig, render

    mix = (a.bad, a.cancel, a.deadline, a.sampled)
    if a.clients < 1 or a.duration <= 0 or min(mix) < 0 or not sum(mix) < 1:
        raise UserError("--clients and --duration must be positive; --bad, --cancel, --deadline and --sampled must "
                        "be >= 0 with a sum below 1 (the rest: greedy requests)")
    if a.max_queue is not None and a.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {a.max_queue}")
    engines = Path(a.engines or "engines/default")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rt = Runtime.from_engines(engines, dtype=AUTO_DTYPE)
    prompts = [r["prompt"] for r in load_prompts(a.prompts, a.limit)]
    print(f"[bench soak] plain references (greedy and seeded) for {len(prompts)} prompts", file=sys.stderr,
          flush=True)
    ids = {p: rt.tokenizer.encode_prompt(p) for p in prompts}
    asks = [(n, None) for n in (*LENGTHS, DEADLINE[1])] + [(n, s) for n in LENGTHS for s in SEEDS]
    refs = {(p, n, s): rt.generate(ids[p], GenerateConfig(max_new_tokens=n, sampling=SamplingConfig(
        **(SAMPLED if s is not None else {}), seed=s))).text for p in prompts for n, s in asks}
    del rt
    queue_cap = max(64, a.clients) if a.max_queue is None else a.max_queue
    repo = render(RepoConfig(engines, out / "repo", slots=a.slots, max_queue=queue_cap))
    if a.faults:
        from . import soak_faults

        return soak_faults.run(a, repo, refs, ids, mix, queue_cap)
    cfg = ServerConfig(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    tally, rss = Tally(), []
    server = TritonServer(cfg).start()
    try:
        t0 = time.monotonic()
        deadline = t0 + a.duration
        threads = [threading.Thread(target=client, args=(k, server, refs, ids, deadline, tally, mix))
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
    finally:
        stop_code = server.stop()  # 0: every model unloaded within the drain
    warm = next((r for t, r, _ in rss if t >= a.duration / 5), rss[0][1])
    summary = {"git_sha": git_sha(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
               "clients": a.clients, "duration_s": a.duration, "slots": a.slots, "max_queue": queue_cap,
               "mix": dict(zip(("bad", "cancel", "deadline", "sampled"), mix)), "counts": tally.counts, "examples": tally.examples,
               "slots_in_use_after": slots, "rss_after_warmup_mb": warm, "rss_end_mb": rss[-1][1],
               "rss_growth_after_warmup": round(rss[-1][1] / warm - 1, 4), "rss_samples": rss,
               "stop_exit_code": stop_code,
               "command": command()}
    atomic.write_text(out / "soak.json", json.dumps(summary, indent=1))
    plot(rss, out / "soak_rss.png")
    print(json.dumps(summary) if a.json else
          f"{tally.line()}; slots in use after: {slots:.0f}; RSS {warm:.0f} -> {rss[-1][1]:.0f} MB "
          f"({summary['rss_growth_after_warmup']:+.1%} after warm-up); the server stopped "
          f"{'cleanly' if stop_code == 0 else f'with exit code {stop_code}'}")
    ok = not (tally.failed() or slots or stop_code)
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
