"""The cost-aware scheduler on hand-made trees, verdicts and timings: pruning keeps ancestor-closed sets worth
their cost, acceptance odds are learned per (depth, rank) and per the drafter's score, depth halves and regrows,
slow speculation falls back."""
from __future__ import annotations

from spork_trt.config import SpecConfig
from spork_trt.spec.scheduler import Scheduler, features
from spork_trt.spec.tree import DraftTree, graft
from spork_trt.spec.verification import Verdict

TREE = DraftTree((0, 10, 11, 12, 13, 14, 15), (-1, 0, 0, 1, 1, 3, 5))  # two forks at the root and under node 1


def sched(**over) -> Scheduler:
    return Scheduler(SpecConfig(tree_width=2, tree_depth=4, tree_budget=6, **over))


def test_features_are_depth_and_sibling_rank():
    assert features(TREE) == ([0, 1, 1, 2, 2, 3, 4], [0, 0, 1, 0, 1, 0, 0])


def test_prune_keeps_every_ancestor_and_is_the_identity_when_off():
    s = sched()
    s.costs.set({0: 1.0, 3: 1.0})  # verification costs (nearly) the same up to 8 nodes and every choice is
    s.odds = {key: [9.0, 10.0] for key in [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (4, 0)]}  # likely: keep all
    assert s.prune(TREE, greedy=True) == list(range(7))
    s.pruned, s.odds = 0, {}
    s.costs.set({0: 1.0, 1: 1.3, 2: 1.6, 3: 4.0})  # a fifth node costs 0.6: more than node 6 brings
    for (d, r) in [(1, 0), (2, 0), (3, 0), (4, 0)]:
        s.odds[(d, r)] = [9.0, 10.0]  # first choices nearly always right
    for (d, r) in [(1, 1), (2, 1)]:
        s.odds[(d, r)] = [0.0, 50.0]  # second choices never
    keep = s.prune(TREE, greedy=True)
    assert keep == [0, 1, 3, 5] and all(TREE.parents[i] in keep for i in keep[1:])  
    assert s.pruned == 3
    assert s.prune(TREE, greedy=False) == list(range(7))  # sampling keeps all drawn siblings
    assert Scheduler(SpecConfig(adaptive=False)).prune(TREE, greedy=True) == list(range(7))


def test_costly_trees_with_poor_odds_prune_to_a_plain_step():
    s = sched()
    s.costs.set({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
    for key in [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (4, 0)]:
        s.odds[key] = [1.0, 40.0]
    assert s.prune(TREE, greedy=True) == [0]


def test_record_learns_odds_and_moves_depth():
    s = sched()
    sub = TREE.subtree([0, 1, 2, 3])  # root, two children, one grandchild under node 1
    s.record(sub, Verdict((0, 1, 3), (10, 12), 99), True, 0.01, 0.02)
    assert s.odds[(1, 0)] == [1.0, 1.0] and s.odds[(1, 1)] == [0.0, 1.0] and s.odds[(2, 0)] == [1.0, 1.0]
    assert s.depth == 4
    s.record(sub, Verdict((0,), (), 99), True, 0.01, 0.02)
    assert s.depth == 2  # level 2: halved after a failed step
    s.record(sub, Verdict((0, 1), (10,), 99), True, 0.01, 0.02)
    assert s.depth == 4  # doubles back


def test_odds_by_the_drafters_score_separate_strong_nodes_from_weak_ones():
    """A node's (depth, rank, strength) estimate starts from its (depth, rank) one and learns its own verdicts:
    long-match nodes (score 1.0) always accepted and short-match ones (0.25) never are told apart, while a score
    never seen falls back to the shared (depth, rank) estimate."""
    s = sched()
    strong, weak = (DraftTree((0, 10), (-1, 0), score=(1.0, x)) for x in (1.0, 0.25))
    for _ in range(20):
        s.record(strong, Verdict((0, 1), (10,), 99), True, 0.01, 0.02)
        s.record(weak, Verdict((0,), (), 99), True, 0.01, 0.02)
    assert s.odds[(1, 0, 4)][0] > 10 and s.odds[(1, 0, 1)][0] == 0.0
    p_strong, p_weak = (s.odds_survival(t)[1] for t in (strong, weak))
    assert p_strong > 0.85 and p_weak < 0.15
    coarse = s.p_accept(1, 0)
    assert 0.3 < coarse < 0.7 and s.odds_survival(DraftTree((0, 10), (-1, 0), score=(1.0, 0.5)))[1] == coarse
    assert s.odds_survival(DraftTree((0, 10), (-1, 0)))[1] == coarse  # a drafter without scores


def test_a_grafted_sources_nodes_keep_odds_of_their_own():
    """store-eagle: the head's nodes grafted onto the store's tree are ranked among their own source's siblings and
    learn their own odds, so nodes of a source that keeps failing are pruned while the other's are kept."""
    s = sched()
    # the store's fork 10 and the head's 20 and 21 grafted on (ranks 0 and 1 in the head's tree)
    tree = graft(DraftTree((0, 10), (-1, 0), score=(1.0, 0.5)),
                 DraftTree((0, 20, 21), (-1, 0, 0), score=(1.0, 0.5, 0.5)), budget=8)
    assert tree.source == (0, 0, 1, 1) and features(tree) == ([0, 1, 1, 1], [0, 0, 0, 1])
    for _ in range(30):
        s.record(tree, Verdict((0, 2), (20,), 99), True, 0.01, 0.02)  # the head's first choice is right
    assert s.odds[(1, 0)][0] == 0.0 and s.odds[("source", 1, 1, 0)][0] > 15 and s.odds[("source", 1, 1, 1)][0] == 0
    assert s.p_accept(1, 0, 2, source=1) > 0.85 > 0.15 > s.p_accept(1, 0, 2)
    s.costs.set({0: 1.0, 1: 1.2, 2: 1.6, 3: 2.4})
    assert s.prune(tree, greedy=True) == [0, 2]  # same depth, rank and strength: only the source tells them apart


def test_level_3_fallback_after_failures_and_when_slower_than_plain():
    s = sched(fail_limit=2, cooldown=3)
    root = DraftTree.root_only(5)
    miss = TREE.subtree([0, 1])
    for _ in range(2):  # proposing costs a third of each step (a draft model): failures count
        s.record(miss, Verdict((0,), (), 7), True, 0.005, 0.01)
    assert not s.speculate() and s.fallbacks == 1
    for _ in range(3):
        s.record(root, Verdict((0,), (), 7), False, 0.0, 0.01)  # plain steps: 100 tokens/s
    assert s.speculate()
    s.record(miss, Verdict((0, 1), (10,), 7), True, 0.05, 0.01)  # 2 tokens in 60 ms: slower than plain
    assert not s.speculate() and s.fallbacks == 2


def test_failures_of_a_cheap_drafter_do_not_switch_it_off():
    """A drafter whose proposals cost under CHEAP_PROPOSAL of a step (n-gram, store) keeps proposing through any
    run of failed steps while adaptive: the allotment pays only for the nodes its odds are worth, and a cooldown
    hid the proposals that would have been accepted. The fixed shape and sampling still count failures."""
    miss = TREE.subtree([0, 1])
    s = sched(fail_limit=2, cooldown=3)
    for _ in range(6):
        s.record(miss, Verdict((0,), (), 7), True, 0.0002, 0.03)
    assert s.speculate() and s.fallbacks == 0 and s.failures == 6 and not s.costly
    s.record(miss, Verdict((0,), (), 7), True, 0.01, 0.03)  # proposals turn costly: the failures count again
    assert not s.speculate() and s.fallbacks == 1
    # the fixed shape verifies every node; a sampled request's draws must not depend on timing: failures count
    for other in (Scheduler(SpecConfig(adaptive=False, fail_limit=2, cooldown=3)),
                  Scheduler(SpecConfig(fail_limit=2, cooldown=3), greedy=False)):
        for _ in range(2):
            other.record(miss, Verdict((0,), (), 7), True, 0.0002, 0.03)
        assert not other.speculate() and other.fallbacks == 1


def test_a_step_whose_allotment_kept_no_node_is_not_a_failure():
    """Under load the allotment often verifies none of a request's nodes: that plain step must not count toward
    level 3's failures nor halve the depth (it did: 3 such steps switched speculation off for `cooldown` steps)."""
    s = sched(fail_limit=2, cooldown=3)
    for _ in range(5):
        s.record(DraftTree.root_only(5), Verdict((0,), (), 7), True, 0.0, 0.01)
    assert s.speculate() and s.fallbacks == 0 and s.failures == 0 and s.depth == 4 and s.odds == {}


def test_nodes_the_allotment_dropped_still_teach_the_odds():
    """Every proposed node whose parent is on the committed path is a fair test, verified or not: a child of the
    root the allotment dropped is accepted iff it is the target's own token. Learning from verified nodes only,
    odds once too low to be verified never rose again: here they recover and the node is verified once more."""
    s = sched()
    s.costs.set({0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6})  # a node is worth verifying at about 0.2 survival or more
    s.odds = {(1, 0): [0.0, 30.0], (1, 1): [0.0, 30.0]}  # learned on text where the drafts were wrong
    assert s.prune(TREE, greedy=True) == [0]
    root = DraftTree.root_only(0)
    for _ in range(40):  # plain steps (nothing verified) whose committed tokens are the first child's: 10, 12
        s.record(root, Verdict((0,), (), 10), True, 0.0, 0.01, proposed=TREE)
    assert s.odds[(1, 0)][0] > 20 and s.odds[(1, 1)][0] == 0.0  # node 1 (token 10) hit, node 2 (11) missed
    assert (2, 0) not in s.odds  # below the committed path (one token deep) nothing is known
    assert s.prune(TREE, greedy=True)[:2] == [0, 1]
    # one deeper: a step verifying node 1 (accepted) whose bonus, 12, is node 3 (dropped) tests node 1's children
    s.record(TREE.subtree([0, 1]), Verdict((0, 1), (10,), 12), True, 0.0, 0.01, proposed=TREE)
    assert s.odds[(2, 0)] == [1.0, 1.0] and s.odds[(2, 1)] == [0.0, 1.0]
    assert s.failures == 0 and s.fallbacks == 0


def test_allot_shares_one_forward_by_goodput():
    """Across requests the most likely nodes win; with a flat cost every node is taken, with a steep one none, and
    one request alone gets what `prune` keeps for it."""
    from spork_trt.spec.cost_model import CostModel
    from spork_trt.spec.scheduler import Candidates, allot

    a = Candidates((1, 2, 3), (0.9, 0.8, 0.1))
    b = Candidates((4, 5), (0.7, 0.05))
    fixed = Candidates((1, 2), (1.0, 1.0), fixed=True)
    linear = CostModel()
    linear.set({0: 1.0, 3: 1.0 + 0.3 * 7})  # 0.3 of a one-token forward per extra token
    # a node pays when its survival beats (tokens per second so far) x (its 0.3 extra cost): about 0.6 here
    assert allot([a, b], linear.seconds) == [2, 1]  # 0.9, 0.8, 0.7 pay; 0.1 and 0.05 do not
    assert allot([a, b], lambda n: 1.0) == [3, 2]
    assert allot([a, b], lambda n: float(n) ** 2) == [0, 0]
    assert allot([a, b, fixed], lambda n: float(n) ** 2) == [0, 0, 2]  # the fixed shape keeps its tree whatever
    assert allot([a, b], lambda n: 1.0, max_tokens=4) == [2, 0]  # 2 roots + the 2 most likely nodes
    s = sched()
    s.costs = linear
    assert allot([Candidates((1, 2, 3), (0.9, 0.8, 0.1))], s.costs.seconds) == [2]
    # padded [B, T]: one node each, 2 x 2 tokens, brings 0.9 + 0.7 for 0.6 more (3.6 / 1.9 = 1.89 tokens per unit,
    # up from 2 / 1.3); a second each brings 0.8 + 0.05 for 0.6 more (4.45 / 2.5 = 1.78): not worth it
    assert allot([a, b], linear.seconds, padded=True) == [1, 1]
    assert allot([a, Candidates((4,), (0.7,))], lambda n: 1.0 + 0.05 * n, padded=True) == [2, 1]  # cheap rows: 2 deep
    assert allot([a, b], lambda n: float(n), padded=True) == [0, 0]  # cost per token: no node pays for itself
    assert allot([a, b, fixed], lambda n: float(n), padded=True) == [2, 2, 2]  # the fixed tree pads them all
    assert allot([a, b], lambda n: 1.0, max_tokens=5, padded=True) == [1, 1]  # 2 x 2 tokens fit, 2 x 3 do not


def test_cost_model_interpolates_and_never_makes_more_tokens_cheaper():
    from spork_trt.spec.cost_model import CostModel

    c = CostModel()
    assert c.seconds(1) == 1.0 and c.seconds(11) > c.seconds(10)  # the prior, in units of one token
    c.record(1, 0.028)
    c.record(16, 0.063)
    assert abs(c.seconds(8) - (0.028 + 7 * 0.035 / 15)) < 1e-9  # on the measured segment
    assert c.seconds(32) > c.seconds(16)
    c.record(4, 0.070)  # noise: 4 tokens measured dearer than 16
    assert c.seconds(10) >= c.seconds(4) and c.seconds(16) > c.seconds(10)
