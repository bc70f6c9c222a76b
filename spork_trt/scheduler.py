"""When and how much to speculate: the cost-aware scheduler and the three recovery levels.

Scores (cheap, online, per request): P(node accepted | parent accepted) per (depth, sibling rank), kept as decayed
counts of the target's verdicts; a node's path survival is the product along its path. Costs: moving averages
of the real target verify time by tree size (power-of-two buckets) and of tokens per second of speculative and
plain steps. Each step:
  - prune (greedy only): keep the most likely nodes (sorted by path survival, so every kept node's parent is kept)
    while expected committed tokens per second of verify time grows; keeping none is a plain step;
  - depth: level 2 recovery halves it after a step with nothing accepted, a success doubles it back;
  - level 3: after `fail_limit` consecutive failed steps, or while measured speculative steps are slower than
    plain ones, decode plainly for `cooldown` steps, then probe again;
  - load (serving): while `busy()` says the host's compute is taken by other requests, steps are plain: a tree
    verify costs more compute than the one token it replaces, so under saturation it lowers throughput.
  - verifier (when a calibrated one is loaded): its path survival replaces the (depth, rank) estimate, nodes below
    the threshold tau are dropped first, and tau moves toward `target_acceptance` of the verified nodes. In
    "auto" it must pay for itself: the target verify time its pruning saves (cost model, against what the
    (depth, rank) pruning alone keeps) must exceed its own measured time. It starts off and is probed after
    FIRST_PROBE speculative steps (once the verify costs are measured); it stays on while it pays; otherwise the
    next probe comes PROBE_EVERY steps later, doubling after each probe that did not pay (up to PROBE_MAX).
Pruning only removes nodes before verification, so the output stays token-for-token lossless.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .config import SpecConfig
from .tree import DraftTree
from .verify import Verdict

DECAY = 0.97  # weight of history per observation (recent text matters most)
PRIOR = (1.0, 2.0)  # pseudo counts (accepted, seen): an unseen (depth, rank) starts at 0.5
EMA = 0.2
COST_SLOPE = 0.05  # prior cost of a tree of T nodes: cost(1) * (1 + slope * (T - 1)), until measured
TAU_BOUNDS = (0.002, 0.9)
TAU_STEP = 0.05  # tau moves by this times (target acceptance - measured acceptance) per scored step
FIRST_PROBE = 4  # speculative steps before "auto" first tries the verifier
PROBE_EVERY = 16  # speculative steps between probes of a verifier switched off (doubles while it does not pay)
PROBE_MAX = 256


def bucket(n: int) -> int:
    return (n - 1).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...


def ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)


@dataclass
class Scheduler:
    spec: SpecConfig
    depth: int = 0  # current draft depth (level 2)
    failures: int = 0  # consecutive speculative steps with nothing accepted
    cooling: int = 0  # plain steps left before probing again
    fallbacks: int = 0  # times speculation was switched off
    pruned: int = 0  # draft nodes dropped before verification
    odds: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (depth, rank) -> [accepted, seen]
    cost: dict[int, float] = field(default_factory=dict)  # tree-size bucket -> verify seconds
    rate: dict[bool, float] = field(default_factory=dict)  # speculated? -> committed tokens per second
    tau: float = 0.0  # pruning threshold on the verifier's path survival
    verifier_on: bool = False  # "auto" only: the verifier currently pays for itself
    verifier_offs: int = 0  # probes after which "auto" left (or switched) the verifier off
    probe_in: int = FIRST_PROBE  # speculative steps until a verifier switched off is tried again
    probe_every: int = PROBE_EVERY
    score_cost: float | None = None  # seconds per verifier call
    score_saving: float | None = None  # target verify seconds its pruning saves per call (cost model)
    baseline_n: int = 0  # nodes the (depth, rank) pruning alone would have verified this step
    recent: float = 0.0  # draft tokens accepted per speculative step, moving average (a verifier feature)
    busy: Callable[[], bool] | None = None  # serving: True while other requests take the compute (plain steps)
    busy_steps: int = 0  # steps decoded plainly because of `busy`

    def __post_init__(self) -> None:
        self.depth, self.tau = self.spec.tree_depth, self.spec.tau

    @property
    def adaptive(self) -> bool:
        """False: the fixed shape, recovery level 3 only."""
        return self.spec.adaptive

    def speculate(self) -> bool:
        if self.busy is not None and self.busy():
            self.busy_steps += 1
            return False
        return self.cooling == 0

    def shape(self) -> SpecConfig:
        return replace(self.spec, tree_depth=self.depth) if self.adaptive else self.spec

    def use_verifier(self, available: bool) -> bool:
        """Whether to score this speculative step with the verifier."""
        mode = self.spec.verifier
        if not available:
            return False
        if mode == "on" or self.spec.gate_tau > 0:  # gate mode needs the scores whatever --verifier says
            return True
        if mode == "off" or self.verifier_on:
            return mode != "off"
        self.probe_in -= 1
        return self.probe_in <= 0

    def p_accept(self, depth: int, rank: int) -> float:
        a, n = self.odds.get((depth, rank), (0.0, 0.0))
        return (a + PRIOR[0]) / (n + PRIOR[1])

    def verify_cost(self, n: int) -> float:
        b = bucket(n)
        if b in self.cost:
            return self.cost[b]
        if 0 in self.cost:
            base = self.cost[0]
        else:  # no plain step measured yet: infer one from any measured size (relative costs are what matter)
            base = min((c / (1 + COST_SLOPE * (2**k - 1)) for k, c in self.cost.items()), default=1.0)
        return base * (1 + COST_SLOPE * (n - 1))

    def prune(self, tree: DraftTree, greedy: bool, survival=None) -> list[int]:
        """Node indices to verify (ascending, root first, ancestor-closed). `survival` [N]: the verifier's path
        survival, when it scored this step."""
        if not greedy or len(tree) == 1:
            return list(range(len(tree)))  # sampling keeps every drawn sibling: the proposals depend on them
        everything = list(range(len(tree)))
        baseline = self.odds_prune(tree) if self.adaptive else everything
        if survival is None:
            keep = baseline
        else:
            self.baseline_n = len(baseline)
            keep = [i for i in everything if i == 0 or survival[i] >= self.tau]
            if self.adaptive:
                keep = self.best_prefix([float(survival[i]) for i in keep], keep)
        self.pruned += len(tree) - len(keep)
        return keep

    def odds_prune(self, tree: DraftTree) -> list[int]:
        """Pruning by the learned (depth, rank) acceptance odds alone."""
        depth, rank = features(tree)
        odds = [1.0]
        for i in range(1, len(tree)):
            odds.append(odds[tree.parents[i]] * self.p_accept(depth[i], rank[i]))
        return self.best_prefix(odds, list(range(len(tree))))

    def best_prefix(self, survival: list[float], index: list[int]) -> list[int]:
        """The most likely nodes (`survival`, ancestor-closed, [0] the root) while expected committed tokens per
        second of verify time grows; returned as `index` entries, ascending."""
        order = sorted(range(1, len(survival)), key=lambda i: (-survival[i], i))
        best_n, best, gain = 0, 1.0 / self.verify_cost(1), 1.0
        for n, i in enumerate(order, start=1):
            gain += survival[i]
            value = gain / self.verify_cost(n + 1)
            if value > best:
                best_n, best = n, value
        return sorted(index[i] for i in [0, *order[:best_n]])

    def record(self, tree: DraftTree, verdict: Verdict, speculated: bool, propose_s: float,
               verify_s: float, score_s: float | None = None) -> None:
        """`tree` as verified; `verdict` over its indices; `score_s`: the verifier's time, when it ran."""
        n = len(tree)
        if score_s is not None and n > 1:
            self.scored(score_s, len(verdict.accepted) / (n - 1), n)
        self.cost[bucket(n)] = ema(self.cost.get(bucket(n)), verify_s)
        committed = len(verdict.accepted) + 1
        self.rate[speculated] = ema(self.rate.get(speculated), committed / max(propose_s + verify_s, 1e-9))
        if not speculated:
            self.cooling = max(0, self.cooling - 1)
            return
        on_path, (depth, rank) = set(verdict.path), features(tree)
        for i in range(1, n):  # each node whose parent was accepted was a fair test of its (depth, rank)
            if tree.parents[i] in on_path:
                odds = self.odds.setdefault((depth[i], rank[i]), [0.0, 0.0])
                odds[0], odds[1] = odds[0] * DECAY + (i in on_path), odds[1] * DECAY + 1
        accepted = len(verdict.accepted)
        self.recent = ema(self.recent, accepted)
        self.failures = 0 if accepted else self.failures + 1
        if self.adaptive:
            self.depth = min(self.spec.tree_depth, self.depth * 2) if accepted else max(1, self.depth // 2)
        slower = self.adaptive and self.rate.get(False, 0.0) > self.rate[True] and n > 1
        if self.failures >= self.spec.fail_limit or slower:
            self.failures, self.cooling = 0, self.spec.cooldown
            self.fallbacks += 1

    def scored(self, score_s: float, acceptance: float, n: int) -> None:
        """After a verified step the verifier scored: move tau, weigh the verifier's cost against its saving."""
        lo, hi = TAU_BOUNDS
        self.tau = min(hi, max(lo, self.tau + TAU_STEP * (self.spec.target_acceptance - acceptance)))
        self.score_cost = ema(self.score_cost, score_s)
        saving = max(0.0, self.verify_cost(self.baseline_n) - self.verify_cost(n)) if self.baseline_n else 0.0
        self.score_saving = ema(self.score_saving, saving)
        if self.spec.verifier != "auto" or self.spec.gate_tau > 0:
            return
        pays = self.score_saving > self.score_cost
        self.verifier_offs += not pays
        self.probe_every = PROBE_EVERY if pays else min(PROBE_MAX, 2 * self.probe_every)
        self.verifier_on, self.probe_in = pays, self.probe_every


def features(tree: DraftTree) -> tuple[list[int], list[int]]:
    """Per node: depth (root 0) and rank among its siblings (drafting order: 0 is the drafter's first choice)."""
    depth, rank, seen = [0], [0], {}
    for i in range(1, len(tree)):
        p = tree.parents[i]
        depth.append(depth[p] + 1)
        rank.append(seen.get(p, 0))
        seen[p] = rank[-1] + 1
    return depth, rank
