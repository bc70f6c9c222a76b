"""`python -m bench costs`: what one forward of the target, of the early-layer verifier and of each model draft
costs by the number of tree nodes it runs (median milliseconds after a committed context): the cost model behind
the scheduler's "does the verifier pay" decision, and the ceiling a draft's cost puts on speculation, measured on
this machine.

The ceiling: a chain of depth M drafted one token per draft forward and verified in one target forward of M + 1
nodes commits at most M + 1 tokens, so no acceptance rate takes a drafter past
    (M + 1) * target(1) / (M * draft(1) + target(M + 1))   tokens per plain step,
which tends to target(1) / draft(1) as M grows (a tree only adds nodes to the same forwards).

`--batch`: one batched forward of the engine core (`forward_batch`) over B sequences of T new tokens each, each in
its own pool slot after its own context, as a step of B decoding requests runs it; a `--batch-tokens` entry A:T
gives the first sequence A new tokens and the others T (one request's tree among plain steps: a padded batch
costs B x A tokens, a packed one A + (B - 1) T)."""
from __future__ import annotations

import json
import statistics
import time

import torch

from spork_trt.config import SamplingConfig
from spork_trt.draft_kinds import EAGLE, is_kind
from spork_trt.engines import SeqInput, chain_input, prefill
from spork_trt.loop.runtime import Runtime
from spork_trt.spec.tree import chain_parents, compile_tree


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 2)


def forward_ms(engine, cache, n: int, repeats: int, run=None, rows: list[int] | None = None) -> float:
    """Median ms of one forward of an n-node chain after `cache`'s committed rows (the rows are dropped), with
    logits at `rows` (None: every node)."""
    buf = compile_tree(chain_parents(n - 1), cache.length)
    ids = torch.tensor([[500 + i for i in range(n)]])

    def once():
        if run is not None:
            run(cache, ids, buf.position_ids, buf.mask)
        else:
            engine.forward(cache, ids, buf.position_ids, buf.mask, rows)
        cache.commit([])  # every repeat runs on the same context

    return median_ms(once, repeats)


def head_ms(rt: Runtime, context: list[int], repeats: int) -> float:
    """Median ms of one step of the learned draft head (--draft eagle) after `context` rows of its own cache: one
    row through the head and the top children of its draft-vocabulary logits (what each greedy draft depth costs)."""
    d = rt.drafter(EAGLE.name, SamplingConfig())
    d.reset([], len(context) + 8)
    n, dim = len(context), d.head.hc.dim
    with torch.inference_mode():
        d.run(context, torch.zeros(n, dim), torch.arange(n), torch.ones(1, n, n, dtype=torch.bool).tril())
        d.cache.commit()
        mask = torch.ones(1, 1, n + 1, dtype=torch.bool)

        def once():
            torch.topk(d.run([500], torch.zeros(1, dim), torch.tensor([n]), mask)[1], 2)  # greedy: draft vocab
            d.cache.commit([])

        return median_ms(once, repeats)


def batch_tokens(spec: str, batch: int) -> list[int]:
    """A --batch-tokens entry for `batch` sequences: "T" (T each) or "A:T" (A for the first, T for the others)."""
    first, _, rest = spec.rpartition(":")
    return [int(first or rest)] + [int(rest)] * (batch - 1)


def batch_ms(engine, tokens: list[int], context: int, repeats: int) -> float:
    """Median ms of one forward_batch of len(tokens) sequences, sequence b with tokens[b] chained new tokens after
    context - 16 b committed rows (at least 16) in its own slot; the new rows are dropped after each repeat."""
    ctx = [max(16, context - 16 * b) for b in range(len(tokens))]
    pool = engine.make_pool(len(tokens), max(ctx) + max(tokens) + 1)
    for c, n in zip(pool.caches, ctx):
        engine.forward_batch([chain_input(c, [100 + i % 1000 for i in range(n)], (n - 1,))])
        c.commit()

    def once():
        engine.forward_batch([SeqInput(c, tuple(range(500, 500 + t)), tuple(range(n, n + t)),
                                       torch.ones(t, t, dtype=torch.bool).tril(), ())
                              for c, n, t in zip(pool.caches, ctx, tokens)])
        for c in pool.caches:
            c.commit([])

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
    cache = target.make_cache(a.context + max(*nodes, a.prefill_chunk) + 1)
    prefill(target, cache, context)
    rows = [{"nodes": n, "target_ms": forward_ms(target, cache, n, a.repeats),
             "verifier_ms": forward_ms(target, cache, n, a.repeats, verifier.forward)}
            for n in nodes]
    chunk = a.prefill_chunk  # a prompt chunk: logits at every row (before logit_rows) vs at its last row only
    prefill_rows = {"tokens": chunk, "all_rows_ms": forward_ms(target, cache, chunk, a.repeats),
                    "last_row_ms": forward_ms(target, cache, chunk, a.repeats, rows=[chunk - 1])}
    t_ms = {r["nodes"]: r["target_ms"] for r in rows}
    drafts = []
    for name in a.drafts:
        if is_kind(name, EAGLE):
            d1 = head_ms(rt, context, a.repeats)
        else:
            engine = rt.draft_engine(name)
            own = engine.make_cache(a.context + max(nodes) + 1)
            prefill(engine, own, context)
            d1 = forward_ms(engine, own, 1, a.repeats)
        x, depth = ceiling(t_ms, d1)
        drafts.append({"draft": name, "draft_ms": d1, "limit": round(t_ms[1] / d1, 2), "ceiling": x,
                       "ceiling_depth": depth})
    batches = [{"batch": b, "tokens": t, "ms": batch_ms(target, batch_tokens(t, b), a.context, a.repeats)}
               for b in (int(x) for x in a.batch.split(",") if x) for t in a.batch_tokens]
    out = {"context": a.context, "verifier_layers": rt.verifier_layers, "rows": rows, "prefill": prefill_rows,
           "drafts": drafts, "batches": batches}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"| nodes | target ms | {rt.verifier_layers}-layer verifier ms |\n| ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['nodes']} | {r['target_ms']:.1f} | {r['verifier_ms']:.1f} |")
    p = prefill_rows
    print(f"\nprefill chunk of {p['tokens']} tokens: {p['all_rows_ms']:.1f} ms with logits at every row, "
          f"{p['last_row_ms']:.1f} ms at the last row only (what the engine core asks for)")
    if batches:
        print("\n| sequences | new tokens each | batched forward ms | ms per sequence |\n| ---: | ---: | ---: | ---: |")
        for r in batches:
            each = r["tokens"].replace(":", " (first), ") + (" (others)" if ":" in r["tokens"] else "")
            print(f"| {r['batch']} | {each} | {r['ms']:.1f} | {r['ms'] / r['batch']:.2f} |")
    if drafts:
        print("\n| draft | one forward ms | target(1) / draft(1) | best speedup at 100% acceptance (depth) |\n"
              "| --- | ---: | ---: | ---: |")
        for d in drafts:
            print(f"| {d['draft']} | {d['draft_ms']:.1f} | {d['limit']:.2f}x | {d['ceiling']:.2f}x "
                  f"({d['ceiling_depth']}) |")
    return 0
