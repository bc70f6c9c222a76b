"""The n-gram drafter's index: proposals identical to scanning the whole context for the suffix (the definition),
on random contexts grown in random pieces."""
from __future__ import annotations

import random

from spork_trt.config import SpecConfig
from spork_trt.spec.drafters import NgramDrafter, trie


def scanned(context: list[int], root: int, spec: SpecConfig, max_n: int, min_n: int):
    """The definition: continuations of the latest matches of the suffix, longest n first, by a full scan."""
    ctx, conts, scores = context + [root], [], []
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i:i + n] == ctx[-n:]:
                cont = ctx[i + n:i + n + spec.tree_depth]
                if cont and not any(c[:len(cont)] == cont for c in conts):
                    conts.append(cont)
                    scores.append(n / max_n)
                    if len(conts) >= spec.tree_width:
                        return trie(root, conts, spec.tree_budget, scores)
    return trie(root, conts, spec.tree_budget, scores)


def test_indexed_proposals_equal_a_full_scan():
    rng = random.Random(0)
    for _ in range(1500):
        vocab = rng.choice([3, 5, 20])
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        d = NgramDrafter(4, rng.choice([1, 2, 3]))
        split = rng.randrange(1, len(ctx) + 1)
        d.reset(ctx[:split], 0)
        d.extend(ctx[split:])  # what commits do
        root = rng.randrange(vocab)
        spec = SpecConfig(tree_width=rng.choice([1, 3]), tree_depth=rng.choice([1, 4, 6]),
                          tree_budget=rng.choice([4, 12]))
        assert d.propose(root, spec) == scanned(ctx, root, spec, 4, d.min_n), (ctx, root, spec)
