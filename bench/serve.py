"""`python -m bench serve`: the served ensemble under load, spork vs plain at each concurrency, on the batching
server (one engine core with `--slots` KV slots) and, in the same run, on a one-at-a-time reference server
(`--max-batch 1`: one slot, requests queue), plus local `generate` on the same prompts (the Triton overhead; only
when a one-client level is measured).

Each level sends max(limit, concurrency) requests from `concurrency` client threads over gRPC streaming. A warm-up
burst per mode at the highest concurrency is excluded; it also brings the engines' memory arenas to their
working-set peak, so the memory figures show growth per request, not the first peak. Per request: time to first
text, end-to-end time, output tokens (steps x mean accepted length, from the response's stats). Per level, from
the server's Prometheus metrics: the mean batch size (requests in a step, averaged over the level's steps).
Output tokens/s is the level's tokens over its wall time, its tail included: once the last request is sent, fewer
clients than `concurrency` have one in flight, and a mode whose requests vary more in length (speculation: each
text's acceptance differs) spends longer there. So each level also reports the steady rate (`steady_level`): tokens
streamed while every client had a request in flight (from the level's start to the first time a client found none
left to send; each request's tokens by then from its streamed stats), when every client sent at least 2 requests. The
server's resident memory (tritonserver plus its python stubs) is read after warm-up and after the sweep.

`--repeats R` measures every (concurrency, mode) level R times, the modes' order alternating (A B, B A, A B, ...) so
a machine that drifts slower or faster over minutes weighs on both alike; per concurrency the summary keeps each
repeat's first-mode / second-mode output tokens/s ratio and their median (`ratios`), the figure to quote.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spork_trt import atomic
from spork_trt.serving.triton_client import ClientConfig, query
from spork_trt.errors import UserError

from .prompts import git_sha, levels_arg, load_prompts
from .run import command


def tree_rss_mb(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def one(prompt: str, cfg: ClientConfig) -> dict:
    r = query(prompt, cfg)
    tokens = round(r.stats["num_steps"] * r.stats["mean_accepted_length"])
    return {"ttft_s": r.ttft_s, "e2e_s": r.time_s, "tokens": tokens,
            "itl_s": (r.time_s - r.ttft_s) / max(1, tokens - 1), "steps": r.stats["num_steps"],
            "accepted": r.stats["total_accepted_draft_tokens"], "drafted": r.stats["total_draft_tokens"],
            "text": r.text, "client": threading.get_ident(), "start": r.start, "progress": r.progress}


def steady_level(rows: list[dict], t0: float) -> float | None:
    """Output tokens/s while every client had a request in flight: from `t0` (the level's start) to the end of the
    earliest of the clients' last requests, each request's tokens counted as streamed by then (`progress`). None
    when a client sent fewer than 2 requests (the window would be the start's prefill burst only)."""
    per_client: dict[int, list[dict]] = {}
    for r in rows:
        per_client.setdefault(r["client"], []).append(r)
    if min(len(v) for v in per_client.values()) < 2:
        return None
    last = [max(v, key=lambda r: r["start"]) for v in per_client.values()]  # each client's last request
    end = min(r["start"] + r["e2e_s"] for r in last)
    tokens = sum(max((n for dt, n in r["progress"] if r["start"] + dt <= end), default=0) for r in rows)
    return round(tokens / (end - t0), 2) if end > t0 else None


def core_counters(metrics_port: int) -> dict[str, float]:
    """The spork model's step counters (summed over its instances)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    names = ("spork_steps_total", "spork_active_request_steps_total")
    return {n: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(n + "{")) for n in names}


def level(prompts: list[str], mode: str, conc: int, server, max_tokens: int, label: str = "") -> dict:
    cfg = ClientConfig(url=server.grpc_url, protocol="grpc", stream=True, max_tokens=max_tokens, spec_mode=mode)
    n = max(len(prompts), conc)
    work = [prompts[k % len(prompts)] for k in range(n)]
    before = core_counters(server.cfg.metrics_port)
    t = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        rows = list(pool.map(lambda p: one(p, cfg), work))
    wall = time.perf_counter() - t
    steady = steady_level(rows, t)
    after = core_counters(server.cfg.metrics_port)
    steps = after["spork_steps_total"] - before["spork_steps_total"]
    batch = (after["spork_active_request_steps_total"] - before["spork_active_request_steps_total"]) / max(steps, 1)
    e2e = [r["e2e_s"] for r in rows]
    drafted = sum(r["drafted"] for r in rows)
    return {"server": label, "mode": mode, "concurrency": conc, "requests": n, "wall_s": round(wall, 3),
            "mean_batch_size": round(batch, 2),
            "requests_per_second": round(n / wall, 3),
            "output_tokens_per_second": round(sum(r["tokens"] for r in rows) / wall, 2),
            "steady_output_tokens_per_second": steady,
            "ttft_p50_s": round(pct([r["ttft_s"] for r in rows], 50), 3),
            "itl_mean_s": round(statistics.fmean(r["itl_s"] for r in rows), 4),
            "e2e_p50_s": round(pct(e2e, 50), 3), "e2e_p90_s": round(pct(e2e, 90), 3),
            "e2e_p99_s": round(pct(e2e, 99), 3),
            "acceptance_rate": round(sum(r["accepted"] for r in rows) / drafted, 3) if drafted else 0.0,
            "texts": [r["text"] for r in rows]}


def local_arm(engines: Path, prompts: list[str], mode: str, max_tokens: int, dtype: str = "fp32") -> dict:
    """Local generate on the same engines, same prompts, one at a time: the no-server reference."""
    from spork_trt.config import GenerateConfig, SpecConfig
    from spork_trt.draft_kinds import AUTO_DRAFT
    from spork_trt.loop.runtime import Runtime

    rt = Runtime.from_build(engines, dtype)
    spec = SpecConfig.for_draft(AUTO_DRAFT)  # what the server renders (--draft auto)
    ids = [rt.tokenizer.encode_prompt(p) for p in prompts]
    rt.generate(ids[0], GenerateConfig(max_new_tokens=16), mode, spec)  # warm-up
    tokens, t = 0, time.perf_counter()
    texts = []
    for p in ids:
        res = rt.generate(p, GenerateConfig(max_new_tokens=max_tokens), mode, spec)
        tokens += len(res.token_ids)
        texts.append(res.text)
    wall = time.perf_counter() - t
    return {"mode": mode, "tokens_per_second": round(tokens / wall, 2), "texts": texts}


def table(s: dict) -> str:
    lines = ["| server | mode | concurrency | repeat | mean batch | requests/s | output tokens/s | steady tokens/s "
             "| TTFT p50 s | ITL mean ms | e2e p50 s | e2e p90 s | e2e p99 s | acceptance |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in s["levels"]:
        steady = r.get("steady_output_tokens_per_second")
        lines.append(f"| {r.get('server', '')} | {r['mode']} | {r['concurrency']} | {r.get('repeat', 0) + 1} "
                     f"| {r.get('mean_batch_size', 1):.1f} "
                     f"| {r['requests_per_second']:.2f} | "
                     f"{r['output_tokens_per_second']:.1f} | {'-' if steady is None else f'{steady:.1f}'} | "
                     f"{r['ttft_p50_s']:.2f} | {r['itl_mean_s'] * 1000:.1f} | "
                     f"{r['e2e_p50_s']:.2f} | {r['e2e_p90_s']:.2f} | {r['e2e_p99_s']:.2f} | "
                     f"{r['acceptance_rate']:.2f} |")
    modes = list(dict.fromkeys(r["mode"] for r in s["levels"]))
    for key, what in (("ratios", "output tokens/s"), ("steady_ratios", "steady tokens/s")):
        for server in dict.fromkeys(x["server"] for x in s.get(key, [])):
            lines.append(f"\n{server}: {modes[0]} / {modes[1]} {what}, median of {s['repeats']} paired repeat(s) "
                         "(each repeat's ratio in brackets): " + "; ".join(
                             f"{x['concurrency']} clients {x['median']:.2f}x "
                             f"({', '.join(f'{v:.2f}' for v in x['ratios'])})"
                             for x in s[key] if x["server"] == server))
    for mode, o in s["overhead"].items():
        lines.append(f"\n{mode}: local generate {o['local_tokens_per_second']:.1f} tokens/s, through Triton at "
                     f"concurrency 1 {o['served_tokens_per_second']:.1f} tokens/s ({o['served_vs_local']:.2f}x); "
                     f"same text: {o['same_text']}")
    for mode, count in s.get("mismatches_vs_plain", {}).items():
        lines.append(f"\n{mode}: {count} prompt text(s) differ from plain's at the same level and repeat "
                     "(lossless: 0)")
    rss = s["server_rss_mb"]
    for label, m in ({"": rss} if "after_warmup" in rss else rss).items():  # older summaries: one server
        lines.append(f"\n{label + ' ' if label else ''}server resident memory: {m['after_warmup']:.0f} MB after "
                     f"warm-up, {m['after_sweep']:.0f} MB after the sweep ({m['growth']:+.1%})")
    return "\n".join(lines)


def sweep(server, prompts: list[str], modes: list[str], levels: list[int], max_tokens: int, label: str,
          repeats: int = 1) -> tuple:
    """Every (concurrency, mode) level on one server, `repeats` times in alternating mode order; returns (rows,
    resident memory figures)."""
    for mode in modes:  # warm-up at the highest concurrency: the engines' memory arenas reach their peak
        level(prompts, mode, max(levels), server, 16, label)
    rss0 = tree_rss_mb(server.proc.pid)
    rows = []
    for conc in levels:
        for k in range(repeats):
            for mode in modes if k % 2 == 0 else modes[::-1]:
                print(f"[bench serve] {label}: {mode} at concurrency {conc} (repeat {k + 1}/{repeats})",
                      file=sys.stderr, flush=True)
                rows.append({**level(prompts, mode, conc, server, max_tokens, label), "repeat": k})
    rss1 = tree_rss_mb(server.proc.pid)
    return rows, {"after_warmup": round(rss0, 1), "after_sweep": round(rss1, 1), "growth": round(rss1 / rss0 - 1, 4)}


def paired_ratios(levels: list[dict], modes: list[str], key: str = "output_tokens_per_second") -> list[dict]:
    """Per (server, concurrency): each repeat's modes[0] / modes[1] `key` (output tokens/s, or the steady rate) and
    their median (levels without a value are left out)."""
    if len(modes) < 2:
        return []
    rate = {(r.get("server", ""), r["concurrency"], r.get("repeat", 0), r["mode"]): r[key]
            for r in levels if r.get(key) is not None}
    out = []
    for server, conc in dict.fromkeys((r.get("server", ""), r["concurrency"]) for r in levels):
        reps = sorted({k for (s, c, k, _m) in rate if (s, c) == (server, conc)})
        ratios = [round(rate[server, conc, k, modes[0]] / rate[server, conc, k, modes[1]], 3) for k in reps
                  if (server, conc, k, modes[0]) in rate and (server, conc, k, modes[1]) in rate]
        if ratios:
            out.append({"server": server, "concurrency": conc, "ratios": ratios,
                        "median": round(statistics.median(ratios), 3)})
    return out


def main(a) -> int:
    from spork_trt.serving.triton_server import ServerConfig, TritonServer, free_port
    from spork_trt.loop.runtime import build_target_device
    from spork_trt.serving.triton_repo import RepoConfig, render

    engines = Path(a.engines or "engines/default")
    levels = levels_arg(a.concurrency, "--concurrency")
    if a.repeats < 1:
        raise UserError(f"--repeats takes a positive integer, got {a.repeats}")
    reference = levels_arg(a.reference_concurrency, "--reference-concurrency") if a.max_batch else []
    modes = a.modes.split(",")
    prompts = [r["prompt"] for r in load_prompts(a.prompts, a.limit)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    servers = [(f"batched ({a.slots} slots)", a.slots, levels)]
    if reference:
        servers.append((f"max-batch {a.max_batch}", a.max_batch, reference))
    summary = {"git_sha": git_sha(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
               "dtype": a.dtype, "prompts": a.prompts, "n_prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "levels": [],
               "server_rss_mb": {}}
    for label, slots, conc in servers:
        repo = render(RepoConfig(engines, out / f"repo-{slots}-slots", slots=slots, max_queue=max(conc),
                                 device=build_target_device(a.dtype) or "", dtype=a.dtype))
        cfg = ServerConfig(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        print(f"[bench serve] starting Triton on {repo} ({label})", file=sys.stderr, flush=True)
        with TritonServer(cfg) as server:
            rows, rss = sweep(server, prompts, modes, conc, a.max_new_tokens, label, a.repeats)
        summary["levels"] += rows
        summary["server_rss_mb"][label] = rss
    summary["overhead"] = {}
    for mode in modes:  # the Triton overhead: local generate against the one-client level (none: skipped)
        served = next((r for r in summary["levels"] if r["mode"] == mode and r["concurrency"] == 1), None)
        if served:
            print(f"[bench serve] local generate ({mode})", file=sys.stderr, flush=True)
            local = local_arm(engines, prompts, mode, a.max_new_tokens, a.dtype)
            summary["overhead"][mode] = {
                "local_tokens_per_second": local["tokens_per_second"],
                "served_tokens_per_second": served["output_tokens_per_second"],
                "served_vs_local": round(served["output_tokens_per_second"] / local["tokens_per_second"], 3),
                "same_text": served["texts"][:len(prompts)] == local["texts"]}
    summary["same_text_across_levels"] = same_text_across_levels(summary["levels"], len(prompts))
    summary["mismatches_vs_plain"] = mismatches_vs_plain(summary["levels"], len(prompts))
    summary["repeats"], summary["ratios"] = a.repeats, paired_ratios(summary["levels"], modes)
    summary["steady_ratios"] = paired_ratios(summary["levels"], modes, "steady_output_tokens_per_second")
    for r in summary["levels"]:
        r.pop("texts")
    summary["command"] = command()
    atomic.write_text(out / "serve_summary.json", json.dumps(summary, indent=1))
    atomic.write_text(out / "serve_summary.md", table(summary) + "\n")
    from .report import latency_plot

    latency_plot(summary, out / "serve.png")
    print(json.dumps(summary) if a.json else table(summary))
    return 0


def mismatches_vs_plain(levels: list[dict], n: int) -> dict[str, int]:
    """Per mode other than plain: prompts whose text differs from plain's at the same server, concurrency and repeat,
    summed over them (lossless, greedy: 0; a level without its plain pair is not counted)."""
    def pair(r: dict) -> tuple:
        return r.get("server"), r["concurrency"], r.get("repeat", 0)
    plain = {pair(r): r["texts"][:n] for r in levels if r["mode"] == "plain"}
    out: dict[str, int] = {}
    for r in levels:
        if r["mode"] != "plain" and pair(r) in plain:
            out[r["mode"]] = out.get(r["mode"], 0) + sum(a != b for a, b in zip(r["texts"][:n], plain[pair(r)]))
    return out


def same_text_across_levels(levels: list[dict], n: int) -> dict[str, bool]:
    """Per mode: every level and server gave each prompt the same text (greedy: batching changes nothing)."""
    out = {}
    for mode in sorted({r["mode"] for r in levels}):
        texts = [[r["texts"][k] for k in range(n)] for r in levels if r["mode"] == mode]
        out[mode] = all(t == texts[0] for t in texts)
    return out
