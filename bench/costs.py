"""`python -m bench costs`: what one forward of the target, of the early-layer verifier and of each model draft
costs by the number of tree nodes it runs (median milliseconds after a committed context): the cost model behind
the scheduler's "does the verifier pay" decision, and the ceiling a draft's cost puts on speculation, measured on
this machine.

The ceiling: a chain of depth M drafted one token per draft forward and verified in one target forward of M + 1
nodes commits at most M + 1 tokens, so no acceptance rate takes a drafter past
    (M + 1) * target(1) / (M * draft(1) + target(M + 1))   tokens per plain step,
which tends to target(1) / draft(1) as M grows (a tree only adds nodes to the same forwards)."""
from __future__ import annotations

import json
import statistics
import time

import torch

from spork_trt.engines import prefill
from spork_trt.runtime import Runtime
from spork_trt.tree import chain_parents, compile_tree


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 2)


def forward_ms(engine, n: int, repeats: int, run=None) -> float:
    """Median ms of one forward of an n-node chain after the engine's committed rows (the rows are dropped)."""
    buf = compile_tree(chain_parents(n - 1), engine.length)
    ids = torch.tensor([[500 + i for i in range(n)]])

    def once():
        (run or engine.forward)(ids, buf.position_ids, buf.mask)
        engine.cache.commit([])  # every repeat runs on the same context

    return median_ms(once, repeats)


def ceiling(target_ms: dict[int, float], draft_1: float) -> tuple[float, int]:
    """The best (M + 1) * target(1) / (M * draft(1) + target(M + 1)) over the measured chain lengths: (x, M)."""
    return max((round((n * target_ms[1]) / ((n - 1) * draft_1 + target_ms[n]), 2), n - 1)
               for n in target_ms if n > 1)


def main(a) -> int:
    rt = Runtime.from_engines(a.engines)
    target, verifier = rt.engine, rt.verifier()
    nodes = sorted({1, *(int(n) for n in a.nodes.split(","))})
    context = [100 + i % 1000 for i in range(a.context)]
    target.reset(a.context + max(nodes) + 1)
    prefill(target, context)
    rows = [{"nodes": n, "target_ms": forward_ms(target, n, a.repeats),
             "verifier_ms": forward_ms(target, n, a.repeats, lambda *x: verifier.forward(target, *x))}
            for n in nodes]
    t_ms = {r["nodes"]: r["target_ms"] for r in rows}
    drafts = []
    for name in a.drafts:
        engine = rt.draft_engine(name).fresh()
        engine.reset(a.context + max(nodes) + 1)
        prefill(engine, context)
        d1 = forward_ms(engine, 1, a.repeats)
        x, depth = ceiling(t_ms, d1)
        drafts.append({"draft": name, "draft_ms": d1, "limit": round(t_ms[1] / d1, 2), "ceiling": x,
                       "ceiling_depth": depth})
    out = {"context": a.context, "verifier_layers": rt.verifier_layers, "rows": rows, "drafts": drafts}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"| nodes | target ms | {rt.verifier_layers}-layer verifier ms |\n| ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['nodes']} | {r['target_ms']:.1f} | {r['verifier_ms']:.1f} |")
    if drafts:
        print("\n| draft | one forward ms | target(1) / draft(1) | best speedup at 100% acceptance (depth) |\n"
              "| --- | ---: | ---: | ---: |")
        for d in drafts:
            print(f"| {d['draft']} | {d['draft_ms']:.1f} | {d['limit']:.2f}x | {d['ceiling']:.2f}x "
                  f"({d['ceiling_depth']}) |")
    return 0
