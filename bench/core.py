"""`python -m bench core`: the engine core in process under load, spork vs plain, priced free of machine drift.

Per concurrency N: `--limit` prompts (cycled up to N) run through one engine core with N slots, N requests in flight
(a finished request's slot takes the next at once: spork_trt.loop.generate.run_many), each mode in turn, `--rounds`
times with the modes' order alternating. Every target forward is timed (its sequences, tokens, whether it is a
prefill chunk). Two rates per run:
- wall: output tokens over the run's wall time;
- priced: output tokens over the same run's work priced by ONE cost table fitted to every forward of the level (all
  runs, both modes): a decode/tree forward costs c(B) for its B sequences, plus j(B) when it holds a tree (ONNX
  Runtime's GroupQueryAttention takes its multi-row path for the whole batch once one sequence has two rows), plus
  k per draft node; a prefill forward a + p x its tokens; plus the run's host time (wall minus its forwards:
  proposing, scheduling, committing) as measured.
On this 2-core machine one level's runs drift by up to 20% within minutes (another tenant, clocks), more than the
effects to measure; the priced rate compares the two modes' work at one machine speed. It is not a wall-clock speed
claim; `bench serve` gives those (through Triton), with `--repeats`. Each spork output is checked against plain's
text of the same prompt (`mismatches`: batched arithmetic may flip a near-tie; anything else is a bug).
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spork_trt import atomic
from spork_trt.loop.admission import size_request
from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.errors import UserError
from spork_trt.loop.generate import run_many
from spork_trt.io_spec import request_config

from .prompts import git_sha, levels_arg, load_prompts


@dataclass(frozen=True)
class Forward:
    seqs: int  # B
    tokens: int  # all sequences' new tokens
    prefill: bool  # a prefill chunk forward (else a decode/tree forward: one row or a tree per sequence)
    seconds: float


class TimedEngine:
    """The target engine with every `forward_batch` logged as a Forward; everything else is the engine's."""

    def __init__(self, engine) -> None:
        self.engine, self.log = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward_batch(self, seqs, hidden=None):
        t = time.perf_counter()
        out = self.engine.forward_batch(seqs, hidden)
        prefill = any(s.logit_rows is not None for s in seqs)  # prompt chunks ask for their last row (or none)
        self.log.append(Forward(len(seqs), sum(len(s.tokens) for s in seqs), prefill, time.perf_counter() - t))
        return out


@dataclass(frozen=True)
class CostTable:
    """Least-squares prices of forwards (seconds): decode[b] + jump[b] if a tree + node x draft nodes; prefill
    forwards prefill[0] + prefill[1] x tokens."""

    decode: dict[int, float]
    jump: dict[int, float]
    node: float
    prefill: tuple[float, float]

    @classmethod
    def fit(cls, forwards: list[Forward]) -> CostTable:
        steps = [f for f in forwards if not f.prefill]
        sizes = sorted({f.seqs for f in steps})
        col = {b: i for i, b in enumerate(sizes)}
        x = np.zeros((len(steps), 2 * len(sizes) + 1))  # [F, decode by B | jump by B | nodes]
        for r, f in enumerate(steps):
            x[r, col[f.seqs]] = 1.0
            if f.tokens > f.seqs:
                x[r, len(sizes) + col[f.seqs]] = 1.0
                x[r, -1] = f.tokens - f.seqs
        coef = np.linalg.lstsq(x, np.array([f.seconds for f in steps]), rcond=None)[0] if steps else np.zeros(1)
        pre = [f for f in forwards if f.prefill]
        if len({f.tokens for f in pre}) > 1:
            p = np.polyfit([f.tokens for f in pre], [f.seconds for f in pre], 1)
            prefill = (float(p[1]), float(p[0]))
        else:  # one chunk size (or none): its mean
            prefill = (statistics.fmean(f.seconds for f in pre) if pre else 0.0, 0.0)
        n = len(sizes)
        return cls({b: float(coef[col[b]]) for b in sizes}, {b: float(coef[n + col[b]]) for b in sizes},
                   float(coef[-1]), prefill)

    def seconds(self, run: Run) -> float:
        """The run's work at this table's prices: its forwards priced, its host time as measured."""
        return sum(self.price(f) for f in run.forwards) + run.host_s

    def price(self, f: Forward) -> float:
        if f.prefill:
            return self.prefill[0] + self.prefill[1] * f.tokens
        tree = f.tokens > f.seqs
        return self.decode[f.seqs] + (self.jump[f.seqs] + self.node * (f.tokens - f.seqs) if tree else 0.0)


@dataclass(frozen=True)
class Run:
    clients: int
    mode: str
    round: int
    tokens: int
    wall_s: float
    forwards: list[Forward]
    mean_batch: float
    drafted: int
    accepted: int
    texts: list[list[int]]

    @property
    def host_s(self) -> float:
        return self.wall_s - sum(f.seconds for f in self.forwards)

    def summary(self, table: CostTable) -> dict:
        priced = table.seconds(self)
        return {"clients": self.clients, "mode": self.mode, "round": self.round, "tokens": self.tokens,
                "wall_s": round(self.wall_s, 3), "priced_s": round(priced, 3),
                "host_s": round(self.host_s, 3), "wall_tok_s": round(self.tokens / self.wall_s, 1),
                "priced_tok_s": round(self.tokens / priced, 1), "mean_batch": round(self.mean_batch, 2),
                "drafted": self.drafted, "accepted": self.accepted,
                "forwards": sum(not f.prefill for f in self.forwards),
                "tree_forwards": sum(not f.prefill and f.tokens > f.seqs for f in self.forwards)}


def run_level(rt, ids: list[list[int]], clients: int, mode: str, rnd: int, cfg: GenerateConfig, spec) -> Run:
    engine = TimedEngine(rt.engine)
    subs = [rt.request(p, cfg, mode, spec) for p in ids]
    max_len = max(size_request(len(p), cfg.max_new_tokens, spec, rt.cfg.max_seq_len).room for p in ids)
    t = time.perf_counter()
    done = {r.sub: r for r in run_many(engine, subs, slots=clients, max_len=max_len)}
    wall = time.perf_counter() - t
    reqs = [done[s] for s in subs]
    steps = [f for f in engine.log if not f.prefill]
    texts = [r.result().token_ids for r in reqs]
    return Run(clients, mode, rnd, sum(map(len, texts)), wall, engine.log,
               statistics.fmean(f.seqs for f in steps) if steps else 0.0,
               sum(r.stats.draft_tokens for r in reqs), sum(r.stats.accepted_tokens for r in reqs), texts)


def main(args) -> int:
    from spork_trt.loop.runtime import Runtime

    levels = levels_arg(args.concurrency, "--concurrency")
    modes = [m for m in args.modes.split(",") if m]
    if args.rounds < 1 or len(modes) != 2 or "plain" not in modes:
        raise UserError("--rounds takes a positive count, --modes two modes, one of them plain (e.g. spork,plain)")
    cfg = request_config({"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed},
                         lambda f: f.flag)  # checked before the engines load
    rt = Runtime.from_build(args.engines, args.dtype)
    spec = SpecConfig.for_draft(rt.resolve_draft(args.draft) if args.draft else rt.default_draft)
    prompts = [rt.tokenizer.encode_prompt(r["prompt"]) for r in load_prompts(args.prompts, args.limit)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, summary = [], []
    for n in levels:
        ids = [prompts[i % len(prompts)] for i in range(max(len(prompts), n))]
        runs = []
        for rnd in range(args.rounds):
            for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                runs.append(run_level(rt, ids, n, mode, rnd, cfg, spec))
                print(f"[core] {n} clients, round {rnd + 1}/{args.rounds}, {mode}: "
                      f"{runs[-1].tokens / runs[-1].wall_s:.1f} tokens/s wall", flush=True)
        table = CostTable.fit([f for r in runs for f in r.forwards])
        rows += [r.summary(table) for r in runs]
        summary.append(level_summary(n, runs, modes, table))
        print(json.dumps(summary[-1]), flush=True)
    meta = {"git_sha": git_sha(), "engines": str(args.engines), "dtype": args.dtype, "draft": spec.draft,
            "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds, "machine": platform.processor() or platform.machine()}
    atomic.write_text(out / "core_runs.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic.write_text(out / "core_summary.json", json.dumps({"meta": meta, "levels": summary}, indent=1))
    atomic.write_text(out / "core_summary.md", markdown(meta, summary))
    print(markdown(meta, summary))
    return 0


def level_summary(n: int, runs: list[Run], modes: list[str], table: CostTable) -> dict:
    spec_mode = next(m for m in modes if m != "plain")
    by = {m: [r for r in runs if r.mode == m] for m in modes}
    pairs = list(zip(by[spec_mode], by["plain"]))  # tokens per second, spork over plain, round by round
    ratio = {"priced_s": [a.tokens / table.seconds(a) / (b.tokens / table.seconds(b)) for a, b in pairs],
             "wall_s": [a.tokens / a.wall_s / (b.tokens / b.wall_s) for a, b in pairs]}
    plain_texts = by["plain"][0].texts
    mismatches = sum(t != p for r in by[spec_mode] for t, p in zip(r.texts, plain_texts))
    return {"clients": n, "mode": spec_mode,
            "priced_ratio_median": round(statistics.median(ratio["priced_s"]), 3),
            "priced_ratios": [round(x, 3) for x in ratio["priced_s"]],
            "wall_ratio_median": round(statistics.median(ratio["wall_s"]), 3),
            "wall_ratios": [round(x, 3) for x in ratio["wall_s"]],
            "mean_batch": {m: round(statistics.fmean(r.mean_batch for r in by[m]), 2) for m in modes},
            "accepted_per_drafted": round(sum(r.accepted for r in by[spec_mode])
                                          / max(sum(r.drafted for r in by[spec_mode]), 1), 3),
            "mismatches": mismatches,
            "cost_table_ms": {"decode": {b: round(s * 1e3, 2) for b, s in table.decode.items()},
                              "jump": {b: round(s * 1e3, 2) for b, s in table.jump.items()},
                              "node": round(table.node * 1e3, 3),
                              "prefill": [round(table.prefill[0] * 1e3, 2), round(table.prefill[1] * 1e3, 4)]}}


def markdown(meta: dict, levels: list[dict]) -> str:
    target = f", target {meta['dtype']}" if meta.get("dtype", "fp32") != "fp32" else ""  # older summaries: none
    lines = [f"engine core in process, git sha {meta['git_sha']}{target}, draft {meta['draft']}, {meta['prompts']} "
             f"(limit {meta['limit']}), {meta['max_new_tokens']} new tokens, {meta['rounds']} rounds", "",
             "| clients | priced spork / plain (median) | per round | wall (median) | per round | mean batch "
             "spork / plain | accepted / drafted | mismatches |",
             "| ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for lv in levels:
        mb = lv["mean_batch"]
        lines.append(f"| {lv['clients']} | **{lv['priced_ratio_median']:.3f}x** | "
                     f"{', '.join(f'{x:.3f}' for x in lv['priced_ratios'])} | {lv['wall_ratio_median']:.3f}x | "
                     f"{', '.join(f'{x:.3f}' for x in lv['wall_ratios'])} | {mb[lv['mode']]} / {mb['plain']} | "
                     f"{lv['accepted_per_drafted']} | {lv['mismatches']} |")
    return "\n".join(lines) + "\n"
