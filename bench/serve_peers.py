"""`python -m bench serve-peers`: our server against llama.cpp's own server under the same load, one after the other,
both through the OpenAI chat API with the same client (the `openai` package, streaming, greedy), prompts and levels.

- ours: `serve` (Triton + the OpenAI API) on `--engines`, `spec_mode` spork;
- llama.cpp: `llama-server` (the C++ server: `--parallel` slots, continuous batching; `make bench-peers` builds it
  from the llama.cpp source llama-cpp-python vendors) on the build's source GGUF, or llama.cpp's own requantization
  of it (`--llama-type q8_0|q4_0`), all cores, its weight repacking off as for the in-process peer
  (peers.no_extra_buffer_types).

Per server and level: output tokens/s over the level's wall time, TTFT p50 / p90, and the texts, compared with ours
(llama.cpp's differ: it multiplies 8-bit activations)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spork_trt import atomic
from spork_trt.checkpoint import manifest as mf
from spork_trt.errors import UserError

from .chat import streamed
from .prompts import git_sha, levels_arg, load_prompts
from .run import command
from .serve import pct

LLAMA_SERVER = ".cache/llama-server/bin/llama-server"  # where `make bench-peers` builds it


def level(client, model: str, prompts: list[str], conc: int, max_tokens: int, mode: str | None) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        done = list(pool.map(lambda p: streamed(client, model, [{"role": "user", "content": p}], max_tokens, mode),
                             prompts))
    wall = time.perf_counter() - t0
    ttft = [d["ttft_s"] for d in done]
    return {"concurrency": conc, "requests": len(done), "wall_s": round(wall, 2),
            "output_tokens_per_second": round(sum(d["completion_tokens"] for d in done) / wall, 2),
            "ttft_p50_s": round(pct(ttft, 50), 3), "ttft_p90_s": round(pct(ttft, 90), 3),
            "texts": [d["text"] for d in done]}


def sweep(base_url: str, model: str, prompts: list[str], levels: list[int], a, mode: str | None, name: str) -> list:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)
    streamed(client, model, [{"role": "user", "content": prompts[-1]}], 16, mode)  # warm-up, excluded
    rows = []
    for conc in levels:
        print(f"[bench serve-peers] {name}: {conc} client(s)", file=sys.stderr, flush=True)
        rows.append({"server": name, **level(client, model, prompts[:max(a.limit or 16, conc)], conc,
                                             a.max_new_tokens, mode)})
    return rows


def ours(engines: Path, out: Path, prompts: list[str], levels: list[int], a) -> list[dict]:
    from spork_trt.serving.openai_api.server import FrontConfig, OpenAIServer
    from spork_trt.serving.triton_server import ServerConfig, TritonServer, free_port
    from spork_trt.serving.triton_repo import RepoConfig, render

    repo = render(RepoConfig(engines, out / "repo", slots=a.slots, max_queue=max(levels)))
    with TritonServer(ServerConfig(repo, http_port=free_port(), grpc_port=free_port(),
                                   metrics_port=free_port())) as server:
        front = OpenAIServer(FrontConfig(repo, server.grpc_url, port=free_port())).start()
        try:
            return sweep(front.url, front.model_name, prompts, levels, a, "spork", "spork_trt (spork)")
        finally:
            front.stop()


def llama(binary: Path, gguf: Path, out: Path, prompts: list[str], levels: list[int], a) -> list[dict]:
    from spork_trt.serving.triton_server import free_port

    port, cores = free_port(), os.cpu_count() or 1
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(a.slots),
           "--ctx-size", str(a.slots * 4096), "--threads", str(cores), "--threads-batch", str(cores), "--no-repack",
           "--jinja"]
    with open(out / "llama-server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_health(f"http://127.0.0.1:{port}/health", proc, out / "llama-server.log")
        return sweep(f"http://127.0.0.1:{port}/v1", gguf.stem, prompts, levels, a, None, f"llama-server ({gguf.name})")
    finally:
        proc.terminate()
        proc.wait(30)


def wait_health(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> None:
    from spork_trt.serving.triton_server import wait_http_ok

    state = wait_http_ok(url, proc, timeout_s)
    if state == "exited":
        raise UserError(f"llama-server exited with code {proc.returncode}; see {log}")
    if state == "timeout":
        raise UserError(f"llama-server was not ready within {timeout_s:.0f} s; see {log}")


def table(s: dict) -> str:
    lines = [f"bench serve-peers, git sha {s['git_sha']}, {s['prompts']} ({s['n_prompts']} prompts a level), "
             f"{s['max_new_tokens']} new tokens, {s['slots']} slots each", "",
             "| server | clients | output tokens/s | TTFT p50 / p90 s | same text as ours |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in s["levels"]:
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['output_tokens_per_second']:.1f} | "
                     f"{r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} | {r['same_as_ours']} |")
    return "\n".join(lines)


def main(a) -> int:
    from .peers import LLAMA_TYPES, llama_quantized, need

    levels = levels_arg(a.concurrency, "--concurrency")
    binary = Path(a.llama_server or LLAMA_SERVER)
    if not binary.is_file():
        raise UserError(f"{binary} not found: `make bench-peers` builds llama-server there (or pass --llama-server)")
    engines = Path(a.engines)
    source = Path(mf.read(engines)["source"]["path"])
    if source.suffix != ".gguf":
        raise UserError(f"llama-server runs GGUF files: {engines} was built from {source}")
    if a.llama_type and a.llama_type not in LLAMA_TYPES:
        raise UserError(f"--llama-type must be one of {', '.join(LLAMA_TYPES)} (or left out: the GGUF as built)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = llama_quantized(need("llama_cpp", "llama-server"), source, a.llama_type, engines / "peers") \
        if a.llama_type else source
    prompts = [r["prompt"] for r in load_prompts(a.prompts, None)]
    rows = ours(engines, out, prompts, levels, a) + llama(binary, gguf, out, prompts, levels, a)
    mine = {r["concurrency"]: r["texts"] for r in rows if r["server"].startswith("spork_trt")}
    for r in rows:
        r["same_as_ours"] = f"{sum(x == y for x, y in zip(r.pop('texts'), mine[r['concurrency']]))}/{r['requests']}"
    summary = {"git_sha": git_sha(), "prompts": a.prompts, "n_prompts": a.limit or 16,
               "max_new_tokens": a.max_new_tokens, "slots": a.slots, "levels": rows, "command": command(),
               "ratios": {c: round(statistics.median(r["output_tokens_per_second"] for r in rows
                                                     if r["concurrency"] == c and r["server"].startswith("spork_trt"))
                                   / statistics.median(r["output_tokens_per_second"] for r in rows
                                                       if r["concurrency"] == c and r["server"].startswith("llama")),
                                   3) for c in levels}}
    atomic.write_text(out / "serve_peers_summary.json", json.dumps(summary, indent=1))
    atomic.write_text(out / "serve_peers_summary.md", table(summary) + "\n")
    print(json.dumps(summary) if a.json else table(summary) + "\n\nspork_trt / llama-server output tokens/s: " +
          ", ".join(f"{c} client(s) {v}x" for c, v in summary["ratios"].items()))
    return 0
