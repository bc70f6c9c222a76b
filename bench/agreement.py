"""`python -m bench agreement`: how closely each quantized copy of the target (the `self-*` engines of a build)
follows the fp32 target: per-token top-1 agreement, teacher-forced on the fp32 target's own greedy outputs for the
same prompts (the question a draft answers: "would the target pick this token next?"), and what one decode step
of each costs. Acceptance and speedup as drafts come from `python -m bench run --arms plain spork/self-...`.
With `--head DIR`, a trained draft head's agreement by depth on the same references (bench/head_agreement.py)."""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

from spork_trt.config import GenerateConfig
from spork_trt.draft_kinds import SELF, named
from spork_trt.engines import forward_chain, prefill
from spork_trt.errors import UserError
from spork_trt import atomic
from spork_trt.checkpoint import manifest as mf
from spork_trt.loop.runtime import Runtime

from .costs import median_ms
from .head_agreement import head_rows, head_table
from .prompts import git_sha, load_prompts


def reference(rt: Runtime, sets: list[str], limit: int | None, max_new: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the fp32 target's greedy output) per prompt."""
    from tqdm import tqdm

    rows = [r for s in sets for r in load_prompts(s, limit)]
    out = []
    for r in tqdm(rows, desc="fp32 greedy references", file=sys.stderr, leave=False):
        ids = rt.tokenizer.encode_prompt(r["prompt"])
        out.append((ids, rt.generate(ids, GenerateConfig(max_new_tokens=max_new)).token_ids))
    return out


def agreement(engine, seqs: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(tokens whose argmax equals the reference's next token, tokens): one forward over prompt + output each."""
    same = total = 0
    for ids, out in seqs:
        logits = forward_chain(engine, engine.make_cache(len(ids) + len(out)), ids + out[:-1])  # [P + N - 1, V]
        pred = logits[len(ids) - 1:].argmax(-1).tolist()  # the prediction for each output token
        same += sum(int(p == t) for p, t in zip(pred, out))
        total += len(out)
    return same, total


def decode_ms(engine, context: int, repeats: int = 15) -> float:
    """Median milliseconds of one 1-token forward after `context` committed tokens."""
    cache = engine.make_cache(context + 1)
    prefill(engine, cache, [100 + i % 1000 for i in range(context)])

    def step():
        forward_chain(engine, cache, [500])
        cache.commit([])

    return median_ms(step, repeats)


def main(a) -> int:
    if a.temperature or a.model or a.seed is not None:
        raise UserError("bench agreement is greedy on a build's engines: drop --temperature, --seed and --model")
    d = Path(a.engines)
    m = mf.read(d)
    if m["engines"]["target"]["precision"] != "fp32":
        raise UserError(f"{d} has a {m['engines']['target']['precision']} target: agreement is measured against "
                        "an fp32 target (build one with --precision fp32)")
    quants = named(m["engines"], SELF)
    if not quants and not a.head:
        raise UserError(f"{d} has no quantized engines: build some with `python -m export build --draft ...`, or "
                        "measure a draft head with --head DIR")
    rt = Runtime.from_engines(d, load_head=False)
    sets = a.prompts.split(",")
    refs = {s: reference(rt, [s], a.limit, a.max_new_tokens) for s in sets}
    seqs = [x for s in sets for x in refs[s]]
    rows = []
    for name in ["target", *quants] if quants else []:
        entry = m["engines"][name]
        engine = rt.engine if name == "target" else rt.draft_engine(name)
        print(f"[agreement] {name}", file=sys.stderr, flush=True)
        same, total = agreement(engine, seqs)
        size = mf.weights(m, entry).get("bytes", 0)
        rows.append({"engine": name, "precision": entry["precision"], "top1_agreement": round(same / total, 4),
                     "tokens": total, "decode_ms": decode_ms(engine, 200), "weights_mb": round(size / 1e6, 1)})
    heads = head_rows(a.head, m["source"], refs) if a.head else []
    out = {"engines": str(d), "prompts": a.prompts, "limit": a.limit, "max_new_tokens": a.max_new_tokens,
           "git_sha": git_sha(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
           "threads": torch.get_num_threads(), "rows": rows, "head": heads}
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        atomic.write_text(Path(a.out) / "agreement.json", json.dumps(out, indent=1))
    tables = [t for t in (rows and table(rows), heads and head_table(heads)) if t]
    print(json.dumps(out) if a.json else "\n\n".join(tables))
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| engine | precision | top-1 agreement with fp32 | tokens | decode step ms | weights MB |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['engine']} | {r['precision']} | {r['top1_agreement']:.3f} | {r['tokens']} | {r['decode_ms']:.1f} "
              f"| {r['weights_mb']:.0f} |" for r in rows]
    return "\n".join(lines)
