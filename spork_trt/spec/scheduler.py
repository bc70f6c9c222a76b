"""When and how much to speculate: the cost-aware scheduler and the three recovery levels.

Scores (cheap, online; the engine core pools them per drafter over its requests): P(node accepted | parent
accepted) per (depth, sibling rank), and per (depth, rank, strength) where strength buckets the drafter's own
score of the node (its matched suffix length for the n-gram and store drafters, its probability for model
drafters); a combined drafter's second source (store-eagle: the head's nodes grafted onto the store's tree) has
tables of its own, its nodes ranked as in the head's own tree. They are kept as decayed counts of the
target's verdicts over every proposed node whose parent lies on the committed path, verified or not (`learn`); a
(depth, rank, strength) estimate starts from its (depth, rank) one (STRENGTH_PRIOR pseudo counts) and moves with its
own verdicts. A node's path survival is the product along its
path. Costs: the engine core's CostModel (seconds of a target forward by the tokens it runs, all requests
together) and moving averages of tokens per second of speculative and plain steps. Each step:
  - prune (greedy only): each request offers its nodes most likely first (`candidates`: sorted by path survival, so
    every node's parent comes first); `allot` sizes every request's tree for the ONE target forward of the step so
    that expected committed tokens per second of it is highest (goodput; a padded [B, T] forward costs B times its
    longest tree): at low load deep trees, at high load a longer tree must beat a whole batch's extra cost, so
    trees shrink toward plain per request, never wholesale. Keeping none is a plain step;
  - depth: level 2 recovery halves it after a step with nothing accepted, a success doubles it back;
  - level 3: after `fail_limit` consecutive failed steps, or while measured speculative steps are slower than
    plain ones, decode plainly for `cooldown` steps, then probe again (a step whose allotment kept no node is a
    plain step: neither a failure, nor a speculative step's rate, nor a reason to halve the depth). Failures
    count only where proposing is costly (the fixed shape, sampling, or proposals over CHEAP_PROPOSAL of a
    step's time: a draft model, the verifier): a cheap drafter's (n-gram, store) failed nodes cost what the
    allotment chose to pay for them, and its odds already steer the allotment away while they fail; a cooldown
    there only hid the proposals that would have been accepted (held-out prompts, batch 1: 1.24x -> 1.27x plain);
  - verifier (when a calibrated one is loaded): its path survival replaces the (depth, rank) estimate, nodes below
    the threshold tau are dropped first; whether it scores at all and how tau moves: verifier_policy.py.
Pruning only removes nodes before verification, so the output stays token-for-token lossless.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from spork_trt.config import SpecConfig
from spork_trt.spec.cost_model import CostModel, ema
from spork_trt.spec.tree import DraftTree
from spork_trt.spec.verifier_policy import VerifierSwitch
from spork_trt.spec.verification import Verdict

DECAY = 0.97  # weight of history per observation (recent text matters most)
MARGIN = 0.05  # a step speculates only when its estimated rate beats the plain step's by this much (estimates err)
PRIOR = (1.0, 2.0)  # pseudo counts (accepted, seen): an unseen (depth, rank) starts at 0.5
STRENGTHS = 4  # the drafter's score of a node in [0, 1], bucketed as round(score * STRENGTHS)
STRENGTH_PRIOR = 2.0  # pseudo counts a (depth, rank, strength) estimate takes from its (depth, rank) one
CHEAP_PROPOSAL = 0.05  # proposing under this share of a speculative step's time is cheap (level 3 ignores failures)


@dataclass(frozen=True)
class Candidates:
    """One request's draft nodes in the order an allotment may take them (most likely first; a node's parent comes
    before it) with each one's path survival. `fixed`: every node is verified (the fixed shape, sampling)."""

    order: tuple[int, ...]  # [K] node indices, the root excluded
    survival: tuple[float, ...]  # [K]
    fixed: bool = False

    def keep(self, count: int) -> list[int]:
        """The root and the first `count` candidates, ascending (ancestor-closed)."""
        return sorted([0, *self.order[:count]])


def allot(cands: list[Candidates], seconds: Callable[[int], float], max_tokens: int | None = None,
          padded: bool = False) -> list[int]:
    """How many of each request's candidates one target forward verifies, so that expected committed tokens per
    second of the forward is highest (every request commits its bonus token; its root is one token of the
    forward), within `max_tokens` tokens of forward.

    Speculating must beat the plain step's estimated rate by MARGIN. Packed forwards cost by their total tokens:
    nodes are taken most likely first across all requests while the rate grows. Padded forwards ([B, T], every
    request padded to the longest tree) cost B * T whatever the shorter trees hold: the longest allotment m is
    chosen, and every request gets its best min(m, its nodes), free."""
    b = len(cands)
    counts = [len(c.order) if c.fixed else 0 for c in cands]
    gain = b + sum(sum(c.survival) for c in cands if c.fixed)
    if padded:
        floor = max(counts, default=0)  # a fixed tree is verified whole: the others are padded to it anyway
        best, best_m = None, floor
        for m in range(floor, max((len(c.order) for c in cands), default=0) + 1):
            if m > floor and max_tokens is not None and b * (1 + m) > max_tokens:
                break
            value = (gain + sum(sum(c.survival[:m]) for c in cands if not c.fixed)) / seconds(b * (1 + m))
            if best is None or value > best * (1 + MARGIN if m > floor and best_m == floor else 1):
                best, best_m = value, m
        return [n if c.fixed else min(best_m, len(c.order)) for n, c in zip(counts, cands)]
    tokens = b + sum(counts)
    queue = sorted((-s, r, j) for r, c in enumerate(cands) if not c.fixed for j, s in enumerate(c.survival))
    plain = best = gain / seconds(tokens)
    best_m = 0
    for m, (neg, _, _) in enumerate(queue, start=1):
        if max_tokens is not None and tokens + m > max_tokens:
            break
        gain -= neg
        value = gain / seconds(tokens + m)
        if value > best and value > plain * (1 + MARGIN):
            best, best_m = value, m
    for _, r, _ in queue[:best_m]:  # a request's candidates are ranked in its own order: each gets a prefix
        counts[r] += 1
    return counts


@dataclass
class Scheduler:
    spec: SpecConfig
    greedy: bool = True  # sampling: no timing-driven decisions (see record)
    depth: int = 0  # current draft depth (level 2)
    failures: int = 0  # consecutive speculative steps with nothing accepted
    cooling: int = 0  # plain steps left before probing again
    fallbacks: int = 0  # times speculation was switched off
    pruned: int = 0  # draft nodes dropped before verification
    odds: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (depth, rank) -> [accepted, seen]
    costs: CostModel = field(default_factory=CostModel)  # target forward seconds by tokens (the core's, shared)
    rate: dict[bool, float] = field(default_factory=dict)  # speculated? -> committed tokens per second
    verifier: VerifierSwitch | None = None  # whether the verifier scores, tau (default: one over `spec`, `costs`)
    recent: float = 0.0  # draft tokens accepted per speculative step, moving average (a verifier feature)
    propose_share: float | None = None  # share of a speculative step's time spent proposing (and scoring), EMA

    def __post_init__(self) -> None:
        self.depth = self.spec.tree_depth
        self.verifier = self.verifier or VerifierSwitch(self.spec, self.costs)

    @property
    def adaptive(self) -> bool:
        """False: the fixed shape, recovery level 3 only."""
        return self.spec.adaptive

    def speculate(self) -> bool:
        return self.cooling == 0

    def shape(self) -> SpecConfig:
        return replace(self.spec, tree_depth=self.depth) if self.adaptive else self.spec

    @property
    def costly(self) -> bool:
        """Failed steps count toward level 3: every node is verified (the fixed shape; sampling, whose draws must
        not depend on timing) or proposing costs CHEAP_PROPOSAL or more of a speculative step."""
        return (not self.adaptive or not self.greedy or self.propose_share is None
                or self.propose_share >= CHEAP_PROPOSAL)

    def p_accept(self, depth: int, rank: int, strength: int | None = None, source: int = 0) -> float:
        keys = odds_keys(depth, rank, strength, source)
        a, n = self.odds.get(keys[0], (0.0, 0.0))
        coarse = (a + PRIOR[0]) / (n + PRIOR[1])
        if strength is None:
            return coarse
        a, n = self.odds.get(keys[1], (0.0, 0.0))
        return (a + STRENGTH_PRIOR * coarse) / (n + STRENGTH_PRIOR)

    def candidates(self, tree: DraftTree, greedy: bool, survival=None) -> Candidates:
        """The tree's draft nodes, most likely first, for `allot`. `survival` [N]: the verifier's path survival,
        when it scored this step (nodes below tau are dropped first)."""
        everything = tuple(range(1, len(tree)))
        if not greedy or len(tree) == 1 or not self.adaptive and survival is None:
            return Candidates(everything, (1.0,) * len(everything), fixed=True)  # sampling: the proposals depend
        if survival is None:  # on every drawn sibling, so it keeps them all
            return ranked(self.odds_survival(tree), everything)
        alone = 1 + self.allot_alone(ranked(self.odds_survival(tree), everything))[0]
        self.verifier.baseline_n = alone if self.adaptive else len(tree)
        kept = tuple(i for i in everything if survival[i] >= self.verifier.tau)
        return ranked([float(survival[i]) for i in range(len(tree))], kept, fixed=not self.adaptive)

    def odds_survival(self, tree: DraftTree) -> list[float]:
        """[N] path survival by the learned (depth, rank) acceptance odds alone."""
        depth, rank = features(tree)
        strength, source = strengths(tree), sources(tree)
        odds = [1.0]
        for i in range(1, len(tree)):
            odds.append(odds[tree.parents[i]] * self.p_accept(depth[i], rank[i], strength[i], source[i]))
        return odds

    def allot_alone(self, cands: Candidates) -> list[int]:
        return allot([cands], self.costs.seconds)

    def prune(self, tree: DraftTree, greedy: bool, survival=None) -> list[int]:
        """Node indices to verify when this request runs alone (ascending, root first, ancestor-closed)."""
        cands = self.candidates(tree, greedy, survival)
        return self.kept(tree, cands, self.allot_alone(cands)[0])

    def kept(self, tree: DraftTree, cands: Candidates, count: int) -> list[int]:
        """The nodes an allotment of `count` keeps; counts the pruned ones."""
        keep = cands.keep(count)
        self.pruned += len(tree) - len(keep)
        return keep

    def record(self, tree: DraftTree, verdict: Verdict, speculated: bool, propose_s: float,
               verify_s: float, score_s: float | None = None, proposed: DraftTree | None = None) -> None:
        """`tree` as verified; `verdict` over its indices; `score_s`: the verifier's time, when it ran; `proposed`:
        the drafter's whole tree (default: `tree`), whose nodes the allotment dropped teach the odds too (learn)."""
        n = len(tree)
        if score_s is not None and n > 1:
            self.verifier.scored(score_s, len(verdict.accepted) / (n - 1), n)
        step_s = max(propose_s + verify_s, 1e-9)
        step_rate = (len(verdict.accepted) + 1) / step_s  # committed tokens per second
        if not speculated:
            self.rate[False] = ema(self.rate.get(False), step_rate)
            self.cooling = max(0, self.cooling - 1)
            return
        self.learn(tree if proposed is None else proposed, [*verdict.accepted, verdict.bonus])
        if n == 1:  # the allotment kept no node (load, low odds): a plain step, not a speculative one nor a failure
            return
        self.rate[True] = ema(self.rate.get(True), step_rate)
        self.propose_share = ema(self.propose_share, propose_s / step_s)
        accepted = len(verdict.accepted)
        self.recent = ema(self.recent, accepted)
        self.failures = 0 if accepted else self.failures + 1
        if self.adaptive:
            self.depth = min(self.spec.tree_depth, self.depth * 2) if accepted else max(1, self.depth // 2)
        # timing decides only under greedy decoding, where no decision can change the output: a sampled request
        # draws the same tokens whatever the load (its draws depend on the trees it verified)
        slower = self.adaptive and self.greedy and self.rate.get(False, 0.0) > self.rate[True]
        if self.failures >= self.spec.fail_limit and self.costly or slower:
            self.failures, self.cooling = 0, self.spec.cooldown
            self.fallbacks += 1

    def learn(self, tree: DraftTree, committed: list[int]) -> None:
        """Acceptance odds from one step: every node whose parent lies on the committed path is a fair test of its
        (depth, rank, strength), verified or not: it is accepted iff its token is the one committed at its depth
        (`committed`: the accepted tokens, then the target's own). So a node the allotment dropped teaches as much as
        one it verified; learning from verified nodes only, odds that fell too low to be verified never rose again
        (under load no node was verified for the rest of the text)."""
        (depth, rank), strength, source = features(tree), strengths(tree), sources(tree)
        on_path = [True]  # [N] the node's tokens from the root are the committed ones
        for i in range(1, len(tree)):
            fair = on_path[tree.parents[i]] and depth[i] <= len(committed)
            hit = fair and tree.tokens[i] == committed[depth[i] - 1]
            on_path.append(hit)
            if fair:
                for key in odds_keys(depth[i], rank[i], strength[i], source[i]):
                    odds = self.odds.setdefault(key, [0.0, 0.0])
                    odds[0], odds[1] = odds[0] * DECAY + hit, odds[1] * DECAY + 1


def ranked(survival: list[float], nodes: tuple[int, ...], fixed: bool = False) -> Candidates:
    """`nodes` most likely first (ties: lower index, so a parent, never less likely than its child, comes first)."""
    order = tuple(sorted(nodes, key=lambda i: (-survival[i], i)))
    return Candidates(order, tuple(survival[i] for i in order), fixed)


def strengths(tree: DraftTree) -> list[int | None]:
    """Per node: the drafter's own score of it, bucketed (None: the drafter gives none)."""
    if tree.score is None:
        return [None] * len(tree)
    return [round(min(max(float(x), 0.0), 1.0) * STRENGTHS) for x in tree.score]


def sources(tree: DraftTree) -> list[int]:
    """Per node: which source of a combined drafter proposed it (0 where the tree does not say)."""
    return list(tree.source) if tree.source is not None else [0] * len(tree)


def odds_keys(depth: int, rank: int, strength: int | None, source: int) -> list[tuple]:
    """The odds table's keys for a node: (depth, rank), then with its strength bucket when the drafter scores
    nodes; a source after the first (a grafted tree's nodes) keeps its own, tagged ("source", s, ...)."""
    coarse = (depth, rank) if not source else ("source", source, depth, rank)
    return [coarse] + ([] if strength is None else [(*coarse, strength)])


def features(tree: DraftTree) -> tuple[list[int], list[int]]:
    """Per node: depth (root 0) and rank among its siblings in its own drafter's tree (0: that drafter's first
    choice; DraftTree.ranks)."""
    depth = [0]
    for p in tree.parents[1:]:
        depth.append(depth[p] + 1)
    return depth, list(tree.ranks())
