"""The cost-aware scheduler on hand-made trees, verdicts and timings: pruning keeps ancestor-closed sets worth
their cost, acceptance odds are learned per (depth, rank), depth halves and regrows, slow speculation falls back."""
from __future__ import annotations

from spork_trt.config import SpecConfig
from spork_trt.scheduler import Scheduler, features
from spork_trt.tree import DraftTree
from spork_trt.verify import Verdict

TREE = DraftTree((0, 10, 11, 12, 13, 14, 15), (-1, 0, 0, 1, 1, 3, 5))  # two forks at the root and under node 1


def sched(**over) -> Scheduler:
    return Scheduler(SpecConfig(tree_width=2, tree_depth=4, tree_budget=6, **over))


def test_features_are_depth_and_sibling_rank():
    assert features(TREE) == ([0, 1, 1, 2, 2, 3, 4], [0, 0, 1, 0, 1, 0, 0])


def test_prune_keeps_every_ancestor_and_is_the_identity_when_off():
    s = sched()
    s.cost = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}  # verification costs the same up to 8 nodes: keep everything
    assert s.prune(TREE, greedy=True) == list(range(7))
    s.cost = {0: 1.0, 1: 1.3, 2: 1.6, 3: 2.2}
    for (d, r) in [(1, 0), (2, 0), (3, 0), (4, 0)]:
        s.odds[(d, r)] = [9.0, 10.0]  # first choices nearly always right
    for (d, r) in [(1, 1), (2, 1)]:
        s.odds[(d, r)] = [0.0, 50.0]  # second choices never
    keep = s.prune(TREE, greedy=True)
    assert keep == [0, 1, 3, 5] and all(TREE.parents[i] in keep for i in keep[1:])  # node 6 would need 5+ nodes
    assert s.pruned == 3
    assert s.prune(TREE, greedy=False) == list(range(7))  # sampling keeps all drawn siblings
    assert Scheduler(SpecConfig(adaptive=False)).prune(TREE, greedy=True) == list(range(7))


def test_costly_trees_with_poor_odds_prune_to_a_plain_step():
    s = sched()
    s.cost = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    for key in [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (4, 0)]:
        s.odds[key] = [1.0, 40.0]
    assert s.prune(TREE, greedy=True) == [0]


def test_record_learns_odds_and_moves_depth():
    s = sched()
    sub = TREE.subtree([0, 1, 2, 3])  # root, two children, one grandchild under node 1
    s.record(sub, Verdict((0, 1, 3), (10, 12), 99), True, 0.01, 0.02)
    assert s.odds[(1, 0)] == [1.0, 1.0] and s.odds[(1, 1)] == [0.0, 1.0] and s.odds[(2, 0)] == [1.0, 1.0]
    assert s.depth == 4 and s.cost[2] == 0.02
    s.record(sub, Verdict((0,), (), 99), True, 0.01, 0.02)
    assert s.depth == 2  # level 2: halved after a failed step
    s.record(sub, Verdict((0, 1), (10,), 99), True, 0.01, 0.02)
    assert s.depth == 4  # doubles back


def test_level_3_fallback_after_failures_and_when_slower_than_plain():
    s = sched(fail_limit=2, cooldown=3)
    root = DraftTree.root_only(5)
    miss = TREE.subtree([0, 1])
    for _ in range(2):
        s.record(miss, Verdict((0,), (), 7), True, 0.0, 0.01)
    assert not s.speculate() and s.fallbacks == 1
    for _ in range(3):
        s.record(root, Verdict((0,), (), 7), False, 0.0, 0.01)  # plain steps: 100 tokens/s
    assert s.speculate()
    s.record(miss, Verdict((0, 1), (10,), 7), True, 0.05, 0.01)  # 2 tokens in 60 ms: slower than plain
    assert not s.speculate() and s.fallbacks == 2


def test_busy_makes_steps_plain_and_keeps_the_output():
    """Serving under load: while busy() holds, steps are plain (no draft verified) and counted; the output is the
    same as plain decoding whatever the load does."""
    from spork_trt.config import GenerateConfig
    from spork_trt.drafters import NgramDrafter
    from spork_trt.engines.torch_engine import TorchEngine
    from spork_trt.generate import generate
    from spork_trt.weights import random_checkpoint
    from tests.conftest import tiny_config

    sched = Scheduler(SpecConfig(), busy=lambda: True)
    assert not sched.speculate() and not sched.speculate() and sched.busy_steps == 2
    model = random_checkpoint(tiny_config(), seed=5, scale=8.0).model
    prompt, cfg = [5, 6, 7, 5, 6, 7, 5, 6], GenerateConfig(max_new_tokens=30)
    want = generate(TorchEngine(model), prompt, cfg, frozenset())
    calls = iter(range(1000))
    for busy, load in ((lambda: True, "all"), (lambda: next(calls) % 3 == 0, "some"), (lambda: False, "none")):
        got = generate(TorchEngine(model), prompt, cfg, frozenset(), drafter=NgramDrafter(4), busy=busy)
        assert got.token_ids == want.token_ids, load
        assert (got.stats.draft_tokens > 0) == (load != "all"), load
        assert (got.stats.busy_steps > 0) == (load != "none"), load
