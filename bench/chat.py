"""`python -m bench chat`: multi-turn MT-bench through the OpenAI API (the real `openai` client, streaming), with
prefix reuse on and off and spork against plain decoding (`--modes`, the API's `spec_mode` extension) in the same run.

Each conversation is one MT-bench question's two turns: the first sends the first question; the second sends the
first question, our own first answer and the second question, as a chat client does. Every level of `--concurrency`
runs `max(limit, concurrency)` conversations from that many client threads, the questions after the previous
level's (so no first turn finds its own question kept from an earlier level; MT-bench's 80 questions wrap around),
against a fresh server per (reuse, mode): prefix reuse on and off (the same engines, slots and queue), in the order
on, off (`--repeats`: alternating), each mode on its own server so that no mode finds another's rows. Per
(reuse, level, turn): time to first token p50 / p90, output tokens/s over the level's wall time (both turns), and the
share of the second turns' prompt tokens whose KV rows were reused (`usage.prompt_tokens_details.cached_tokens`).
Lossless: each turn's text with reuse on is compared with reuse off, and spork's with plain's (greedy: 0
mismatches).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle, islice
from pathlib import Path

from spork_trt import atomic
from spork_trt.errors import UserError
from spork_trt.io_spec import SERVED_MODES
from spork_trt.prompts import data_file, read_jsonl

from .prompts import git_sha, levels_arg
from .run import command
from .serve import pct


def conversations(name: str) -> list[tuple[str, str]]:
    """(first question, second question) of each MT-bench question (or a JSONL file with two `turns`); the levels
    take `--limit` of them each, in turn."""
    rows = read_jsonl(data_file("mt_bench", "question.jsonl") if name == "mt_bench" else Path(name))
    out = [(r["turns"][0], r["turns"][1]) for r in rows if len(r.get("turns", ())) >= 2]
    if not out:
        raise UserError(f"{name}: no question with two turns")
    return out


def streamed(client, model: str, messages: list[dict], max_tokens: int, mode: str | None) -> dict:
    """One streamed chat answer: its text, time to first token, tokens and usage (`mode`: our spec_mode extension,
    None for another server)."""
    t0, first, text, usage = time.perf_counter(), None, [], None
    for c in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"spec_mode": mode} if mode else None):
        if c.choices and c.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(c.choices[0].delta.content)
        if c.usage:
            usage = c.usage
    end = time.perf_counter()
    return {"text": "".join(text), "ttft_s": (first or end) - t0, "e2e_s": end - t0,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def conversation(client, model: str, turns: tuple[str, str], max_tokens: int, mode: str) -> list[dict]:
    first = streamed(client, model, [{"role": "user", "content": turns[0]}], max_tokens, mode)
    second = streamed(client, model, [{"role": "user", "content": turns[0]},
                                      {"role": "assistant", "content": first["text"]},
                                      {"role": "user", "content": turns[1]}], max_tokens, mode)
    return [first, second]


def level(client, model: str, todo: list[tuple[str, str]], conc: int, max_tokens: int, mode: str) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        done = list(pool.map(lambda c: conversation(client, model, c, max_tokens, mode), todo))
    wall = time.perf_counter() - t0
    row = {"concurrency": conc, "conversations": len(todo), "wall_s": round(wall, 2),
           "output_tokens_per_second": round(sum(t["completion_tokens"] for c in done for t in c) / wall, 2),
           "texts": [[t["text"] for t in c] for c in done]}
    for k in (0, 1):
        turns = [c[k] for c in done]
        ttft = [t["ttft_s"] for t in turns]
        row[f"turn{k + 1}"] = {"ttft_p50_s": round(pct(ttft, 50), 3), "ttft_p90_s": round(pct(ttft, 90), 3),
                               "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
                               "cached_tokens": sum(t["cached_tokens"] for t in turns)}
    return row


def serve_and_measure(engines: Path, out: Path, reuse: bool, mode: str, a, levels: list[int], convs) -> list[dict]:
    from openai import OpenAI

    from spork_trt.serving.openai_api.server import FrontConfig, OpenAIServer
    from spork_trt.serving.triton_server import ServerConfig, TritonServer, free_port
    from spork_trt.cli.serving import served_target
    from spork_trt.serving.triton_repo import RepoConfig, render

    repo = render(RepoConfig(engines, out / f"repo-reuse-{'on' if reuse else 'off'}", slots=a.slots,
                             max_queue=max(levels), prefix_reuse=reuse))
    cfg = ServerConfig(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    print(f"[bench chat] starting Triton and the OpenAI API, prefix reuse {'on' if reuse else 'off'}, {mode}",
          file=sys.stderr, flush=True)
    rows = []
    with TritonServer(cfg) as server:
        front = OpenAIServer(FrontConfig(repo, server.grpc_url, port=free_port())).start()
        try:
            client = OpenAI(base_url=front.url, api_key="none", max_retries=0, timeout=600)
            conversation(client, front.model_name, convs[-1], 16, mode)  # warm-up, excluded
            questions = cycle(convs[:-1])
            for conc in levels:
                print(f"[bench chat] reuse {'on' if reuse else 'off'}, {mode}: {conc} client(s)", file=sys.stderr,
                      flush=True)
                todo = list(islice(questions, max(a.limit or 16, conc)))
                rows.append({"reuse": reuse, "mode": mode, "target": served_target(repo),
                             **level(client, front.model_name, todo, conc, a.max_new_tokens, mode)})
        finally:
            front.stop()
    return rows


def mismatches(rows: list[dict], key: str) -> int:
    """Turns whose text differs between the two values of `key` ("reuse" or "mode") at the same level, repeat and
    other setting: the same conversations, since every server takes the questions in the same order (lossless: 0)."""
    other, groups = "mode" if key == "reuse" else "reuse", {}
    for r in rows:
        groups.setdefault((r["concurrency"], r["repeat"], r[other]), []).append(r)
    return sum(x != y for g in groups.values() if len(g) == 2
               for ca, cb in zip(g[0]["texts"], g[1]["texts"]) for x, y in zip(ca, cb))


def median_ratio(rows: list[dict], conc: int, key: str, num, den, metric) -> float | None:
    """median over rows of `metric` where `key` is `num`, over the same where it is `den`, at one level."""
    med = statistics.median
    top = [metric(r) for r in rows if r["concurrency"] == conc and r[key] == num]
    bottom = [metric(r) for r in rows if r["concurrency"] == conc and r[key] == den]
    return round(med(top) / med(bottom), 3) if top and bottom else None


def ratios(rows: list[dict]) -> list[dict]:
    """Per level: reuse on against off (second-turn TTFT p50, output tokens/s; spork's rows when there are, else
    plain's) and spork against plain (output tokens/s with reuse on), medians over repeats."""
    out = []
    for conc in sorted({r["concurrency"] for r in rows}):
        mode = "spork" if any(r["mode"] == "spork" for r in rows) else "plain"
        same = [r for r in rows if r["mode"] == mode]
        on = [r for r in rows if r["reuse"]]
        out.append({"concurrency": conc, "mode": mode,
                    "turn2_ttft_p50_on_over_off": median_ratio(same, conc, "reuse", True, False,
                                                               lambda r: r["turn2"]["ttft_p50_s"]),
                    "tokens_per_second_on_over_off": median_ratio(same, conc, "reuse", True, False,
                                                                  lambda r: r["output_tokens_per_second"]),
                    "tokens_per_second_spork_over_plain": median_ratio(on, conc, "mode", "spork", "plain",
                                                                       lambda r: r["output_tokens_per_second"])})
    return out


def table(s: dict) -> str:
    lines = [f"bench chat, git sha {s['git_sha']}, {s['conversations']} two-turn conversations a level, "
             f"{s['max_new_tokens']} new tokens a turn, {s['slots']} slots; served: {s.get('target', '?')}", "",
             "| reuse | mode | clients | turn 1 TTFT p50 / p90 s | turn 2 TTFT p50 / p90 s | turn 2 cached | output "
             "tokens/s |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in s["levels"]:
        t1, t2 = r["turn1"], r["turn2"]
        lines.append(f"| {'on' if r['reuse'] else 'off'} | {r['mode']} | {r['concurrency']} | {t1['ttft_p50_s']:.3f} "
                     f"/ {t1['ttft_p90_s']:.3f} | {t2['ttft_p50_s']:.3f} / {t2['ttft_p90_s']:.3f} | "
                     f"{t2['cached_tokens'] / max(t2['prompt_tokens'], 1):.0%} | {r['output_tokens_per_second']:.1f} |")
    lines.append("")
    lines += [f"{r['concurrency']} client(s), {r['mode']}: turn-2 TTFT p50 on / off {r['turn2_ttft_p50_on_over_off']}x,"
              f" output tokens/s on / off {r['tokens_per_second_on_over_off']}x"
              + (f"; spork / plain (reuse on) {r['tokens_per_second_spork_over_plain']}x"
                 if r["tokens_per_second_spork_over_plain"] is not None else "") for r in s["ratios"]]
    lines.append(f"texts differing between reuse on and off: {s['mismatches']['reuse']}, between spork and plain: "
                 f"{s['mismatches']['mode']} (lossless: 0)")
    return "\n".join(lines)


def main(a) -> int:
    levels = levels_arg(a.concurrency, "--concurrency")
    if a.repeats < 1:
        raise UserError(f"--repeats takes a positive integer, got {a.repeats}")
    convs = conversations(a.prompts)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = a.modes.split(",")
    if not modes or any(m not in SERVED_MODES for m in modes) or len(set(modes)) != len(modes):
        raise UserError(f"--modes takes a comma list of {', '.join(SERVED_MODES)}, got {a.modes!r}")
    rows = []
    for i in range(a.repeats):
        for reuse in ((True, False) if i % 2 == 0 else (False, True)):
            for mode in modes:
                rows += [{**r, "repeat": i}
                         for r in serve_and_measure(Path(a.engines), out, reuse, mode, a, levels, convs)]
    summary = {"git_sha": git_sha(), "conversations": a.limit or 16, "max_new_tokens": a.max_new_tokens,
               "slots": a.slots, "target": rows[0]["target"], "levels": rows, "ratios": ratios(rows),
               "mismatches": {"reuse": mismatches(rows, "reuse"), "mode": mismatches(rows, "mode")},
               "command": command()}
    for r in rows:
        r.pop("texts")
    atomic.write_text(out / "chat_summary.json", json.dumps(summary, indent=1))
    atomic.write_text(out / "chat_summary.md", table(summary) + "\n")
    print(json.dumps(summary) if a.json else table(summary))
    return 0
