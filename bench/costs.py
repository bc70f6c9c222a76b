"""`python -m bench costs`: what one forward of the target and of the early-layer verifier costs by the number of
tree nodes it runs (median milliseconds after a committed context): the cost model behind the scheduler's
"does the verifier pay" decision, measured on this machine."""
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


def main(a) -> int:
    rt = Runtime.from_engines(a.engines)
    target, verifier = rt.engine, rt.verifier()
    nodes = [int(n) for n in a.nodes.split(",")]
    target.reset(a.context + max(nodes) + 1)
    prefill(target, [100 + i % 1000 for i in range(a.context)])
    rows = []
    for n in nodes:
        buf = compile_tree(chain_parents(n - 1), target.length)
        ids = torch.tensor([[500 + i for i in range(n)]])

        def run_target():
            target.forward(ids, buf.position_ids, buf.mask)
            target.cache.commit([])  # drop the rows: every repeat runs on the same context

        def run_verifier():
            verifier.forward(target, ids, buf.position_ids, buf.mask)

        rows.append({"nodes": n, "target_ms": median_ms(run_target, a.repeats),
                     "verifier_ms": median_ms(run_verifier, a.repeats)})
    out = {"context": a.context, "verifier_layers": rt.verifier_layers, "rows": rows}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"| nodes | target ms | {rt.verifier_layers}-layer verifier ms |\n| ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['nodes']} | {r['target_ms']:.1f} | {r['verifier_ms']:.1f} |")
    return 0
