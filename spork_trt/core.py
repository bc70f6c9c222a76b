"""The engine core: every active request stepped together (continuous batching) over one preallocated KV pool.

One `step()`: admit waiting requests into free slots; each decoding request's drafter proposes a tree, the verifier
scores it, and the scheduler's goodput allotment (scheduler.allot) decides across ALL requests which nodes ONE
target forward verifies; then per request: verify, commit, stream (into its outbox), recover. Prompts are
prefilled in chunks under a per-step token budget in a second forward of the same step, so a long prompt never
stalls the others. Requests join and leave between steps; a cancelled one leaves at the next step and frees its
slot. `generate` (generate.py) is this core with a batch of one: one code path for the CLI, the bench and the
server.

The core never calls back into its caller: a request's cancellation is a field the core reads; its new tokens,
stats and result are fields the caller reads after each step.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .admission import size_request
from .config import GenerateConfig, SpecConfig
from .cost_model import CostModel
from .draft_switch import DraftSwitch
from .drafters import drive
from .engines import SeqInput, chain_input
from .errors import QueueFull
from .kv_cache import KVPool
from .sampling import make_generator, pick, processed_probs
from .scheduler import Candidates, Scheduler, allot
from .stats import Stats
from .stopping import StopState
from .tree import DraftTree, compile_tree
from .verifier import Scored, ScoreJob, Verifier, gate_path, score_batch
from .verify import Verdict, verify_greedy, verify_sampling


@dataclass(frozen=True)
class Verified:
    """One target-verified step of a request that records them (calibration labels its nodes from these)."""

    tree: DraftTree  # the proposal
    scored: Scored | None  # the verifier's scores, None when it did not score
    verdict: Verdict  # over `tree`


@dataclass(frozen=True)
class CoreConfig:
    slots: int = 1  # requests decoded at once (KV pool slots)
    max_len: int = 2048  # positions per slot: prompt + new tokens + a draft tree's room
    step_tokens: int = 256  # most tokens of a step's tree forward (every request's root and verified nodes)
    prefill_tokens: int = 128  # most prompt tokens a step prefills (all joining requests together)
    max_queue: int = 64  # requests waiting for a slot; more are refused (QueueFull)


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (EOS excluded)
    stop_reason: str  # "eos" | "stop_string" | "max_tokens" | "cancelled"
    stats: Stats
    text: str | None = None  # set when a decode function was given
    verified: list[Verified] = field(default_factory=list)  # every verified step, when the request recorded them


@dataclass(eq=False)
class Request:
    """One request's whole state. The caller sets the first block (and `cancelled`); the core owns the rest."""

    prompt_ids: list[int]  # [n]
    cfg: GenerateConfig
    eos_ids: frozenset[int] = frozenset()
    spec: SpecConfig = SpecConfig()
    drafter: object | None = None  # drafters.Drafter; None: plain decoding
    verifier: Verifier | None = None  # scores draft nodes (pruning; gate mode needs it)
    decode: Callable[[list[int]], str] | None = None  # token ids -> text: stop strings and the result's text
    record: bool = False  # keep every verified step in `verified` (calibration)
    cancelled: bool = False  # set by the caller: the request leaves at the next step, its slot freed
    # ---- the core's
    stats: Stats = field(default_factory=Stats)  # filled in as the request runs
    outbox: list[int] = field(default_factory=list)  # committed tokens the caller has not taken yet
    verified: list[Verified] = field(default_factory=list)  # with `record`: every target-verified step so far
    stop: StopState | None = None
    sched: Scheduler | None = None
    gen: torch.Generator | None = None
    slot: int | None = None
    target: object | None = None  # the target engine bound to the slot's cache
    room: int = 0  # positions the request may use: prompt + new tokens + a tree (admission.Size)
    prefilled: int = 0  # prompt tokens run so far
    root: int | None = None  # the last committed token, not yet run by the target (None while prefilling)
    behind: list[int] = field(default_factory=list)  # gate mode: committed tokens before the root not yet run
    t0: float = 0.0
    finished: bool = False

    def take(self) -> list[int]:
        """Committed tokens since the last take."""
        out, self.outbox = self.outbox, []
        return out

    @property
    def can_score(self) -> bool:
        return self.verifier is not None and (self.verifier.head is not None or self.spec.verifier == "on")

    def result(self) -> GenerationResult:
        reason = "cancelled" if self.cancelled and self.stop.reason is None else self.stop.reason
        text = self.stop.text() if self.decode and self.stop.reason else None
        return GenerationResult(list(self.stop.tokens), reason, self.stats, text, self.verified)


@dataclass(frozen=True)
class Plan:
    """A decoding request's proposal before scoring."""

    proposed: DraftTree
    speculate: bool
    scoring: bool  # the verifier scores it
    propose_s: float


@dataclass
class Draft:
    """A decoding request's proposal this step."""

    proposed: DraftTree
    scored: Scored | None
    gated: list[int]  # gate mode: the path the verifier alone accepts (lossy); [] otherwise
    cands: Candidates | None  # what the allotment may verify (None when gated)
    speculated: bool
    propose_s: float
    score_s: float


@dataclass(frozen=True)
class TreeWork:
    """What the target verifies for one request this step."""

    keep: list[int]  # verified nodes, as indices into the proposal (ascending, root first)
    tree: DraftTree  # the proposal cut to them
    children: tuple[tuple[int, ...], ...]  # [N] children of each node of `tree`
    seq: SeqInput  # the forward's input: gate mode's behind tokens, then `tree`


class EngineCore:
    def __init__(self, engine, context: int, cfg: CoreConfig = CoreConfig()) -> None:
        self.engine, self.context, self.cfg = engine, context, cfg  # engine: stateless over the pool's slots
        self.pool: KVPool = engine.make_pool(cfg.slots, cfg.max_len)
        self.costs = CostModel()  # target forward seconds by tokens, shared by every request's scheduler
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.batch_tokens = 0  # tokens of the last step's tree forward (a metric)
        self.switch = DraftSwitch()  # whether a step proposes at all, measured per batch size
        # per drafter: acceptance odds by ([source,] depth, rank[, strength]) pooled over its requests
        # (Scheduler.odds): a request of 128 tokens sees too few verdicts to learn them alone (its estimates stayed
        # near the 0.5 prior, about twice what the store's nodes are accepted at); shared, the allotment's
        # expectations match
        self.odds: dict[str, dict] = {}

    def add(self, r: Request) -> Request:
        """Queue a request (validated here: bad input raises UserError, a full queue QueueFull)."""
        size = size_request(len(r.prompt_ids), r.cfg.max_new_tokens, r.spec, self.context, self.pool.max_len)
        r.room = size.room
        if len(self.waiting) >= self.cfg.max_queue + len(self.pool.free):  # free slots take them at the next step
            raise QueueFull(f"all {self.pool.slots} slots are in use and {self.cfg.max_queue} requests wait for one "
                            f"(max_queue): retry later")
        r.stop = StopState(r.eos_ids, size.max_new, r.cfg.stop_strings, r.decode)
        r.sched = Scheduler(r.spec, greedy=r.cfg.greedy, costs=self.costs,
                            odds=self.odds.setdefault(r.spec.draft, {}))
        r.gen = make_generator(r.cfg.sampling.seed)
        r.t0 = time.perf_counter()
        self.waiting.append(r)
        return r

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting

    def step(self) -> list[Request]:
        """One step over every active request; returns the requests that finished (or left) in it."""
        done = self.retire([r for r in (*self.waiting, *self.active) if r.cancelled])
        self.admit()
        decoding = [r for r in self.active if r.root is not None]
        prefilling = [r for r in self.active if r.root is None]
        # the switch decides (and learns from) only steps with a greedy request that would follow it
        switched = any(r.drafter is not None and r.cfg.greedy for r in decoding)
        t0, drafting = time.perf_counter(), switched and self.switch.propose(len(decoding))
        drafts = self.propose(decoding, drafting)
        padded = self.engine.padded_batches
        counts = allot([d.cands or Candidates((), ()) for d in drafts], self.costs.seconds, self.cfg.step_tokens,
                       padded)
        self.switch.allotted([n for d, n in zip(drafts, counts) if d.cands is not None and d.cands.order])
        trees = {r: self.tree_work(r, d, n) for r, d, n in zip(decoding, drafts, counts) if not d.gated}
        t = time.perf_counter()
        hidden = [] if any(wants_hidden(r) for r in trees) else None  # [n_b, k*C] each: the draft head's features
        logits = dict(zip(trees, self.engine.forward_batch([w.seq for w in trees.values()], hidden))) if trees else {}
        features = {r: h for r, h in zip(trees, hidden or ()) if wants_hidden(r)}
        verify_s = time.perf_counter() - t
        if trees:
            sizes = [len(w.seq.tokens) for w in trees.values()]
            self.batch_tokens = sum(sizes)
            self.costs.record(len(sizes) * max(sizes) if padded else self.batch_tokens, verify_s)
        committed = sum(self.commit(r, d, trees.get(r), logits.get(r), verify_s, features.get(r))
                        for r, d in zip(decoding, drafts))
        if switched:
            self.switch.record(len(decoding), drafting, committed, time.perf_counter() - t0)
        self.prefill(prefilling)
        return done + self.retire([r for r in self.active if r.stop.reason is not None])

    def admit(self) -> None:
        while self.waiting and (slot := self.pool.take()) is not None:
            r = self.waiting.popleft()
            r.slot, r.target = slot, self.engine.fresh()
            r.target.cache = self.pool.caches[slot]
            self.active.append(r)

    def retire(self, leaving: list[Request]) -> list[Request]:
        now = time.perf_counter()
        for r in leaving:
            if r in self.waiting:
                self.waiting.remove(r)
            else:
                self.active.remove(r)
                self.pool.give_back(r.slot)
                r.slot, r.target = None, None
            st, sc = r.stats, r.sched
            st.time_s, st.fallbacks, st.pruned_tokens, st.verifier_offs = now - r.t0, sc.fallbacks, sc.pruned, \
                sc.verifier_offs
            r.finished = True
        return leaving

    def propose(self, reqs: list[Request], drafting: bool = True) -> list[Draft]:
        """Each request's drafter proposes; the trees the verifier scores run through ONE verifier forward
        (verifier.score_batch; its time shared among them); then each request's candidates for the allotment.
        `drafting`: the draft switch's choice for this step; a sampled request ignores it (its seeded draws depend
        on its trees, so they must not depend on timing or on the other requests)."""
        plans = self.plan(reqs, drafting)
        scores: dict[Request, Scored] = {}
        groups: dict[int, list[tuple[Request, Plan]]] = {}  # by verifier engine (a runtime's requests share one)
        for r, p in zip(reqs, plans):
            if p.scoring:
                groups.setdefault(id(r.verifier.engine), []).append((r, p))
        t = time.perf_counter()
        for group in groups.values():
            jobs = [ScoreJob(r.verifier, r.target, r.behind, p.proposed, r.sched.recent,
                             [*r.prompt_ids, *r.stop.tokens], len(r.prompt_ids)) for r, p in group]
            scores.update(zip((r for r, _ in group), score_batch(jobs)))
        score_s = (time.perf_counter() - t) / max(len(scores), 1)
        return [self.draft(r, p, scores.get(r), score_s) for r, p in zip(reqs, plans)]

    def plan(self, reqs: list[Request], drafting: bool) -> list[Plan]:
        """Each request's proposal. Model drafters (`proposing`) run together: each draft depth of every request is
        ONE batched forward of the draft engine (drafters.drive; its time shared among them); the others propose
        one by one."""
        speculate = [(drafting or not r.cfg.greedy) and r.drafter is not None and r.sched.speculate()
                     for r in reqs]
        trees, seconds = {}, {}
        for r, sp in zip(reqs, speculate):
            if sp and not r.drafter.batched:
                t = time.perf_counter()
                trees[r] = r.drafter.propose(r.root, r.sched.shape())
                seconds[r] = time.perf_counter() - t
        batched = [r for r, sp in zip(reqs, speculate) if sp and r not in trees]
        t = time.perf_counter()
        trees.update(zip(batched, drive([r.drafter.proposing(r.root, r.sched.shape()) for r in batched])))
        seconds.update(dict.fromkeys(batched, (time.perf_counter() - t) / max(len(batched), 1)))
        plans = []
        for r, sp in zip(reqs, speculate):
            gate = r.spec.gate_tau > 0
            scoring = sp and (r.cfg.greedy or gate) and r.sched.use_verifier(r.can_score)
            plans.append(Plan(trees[r] if sp else DraftTree.root_only(r.root), sp, scoring, seconds.get(r, 0.0)))
        return plans

    def draft(self, r: Request, p: Plan, scored: Scored | None, score_s: float) -> Draft:
        gated = gate_path(p.proposed, scored, r.spec.gate_tau) if r.spec.gate_tau > 0 and scored else []
        survival = None if scored is None else scored.survival
        cands = None if gated else r.sched.candidates(p.proposed, r.cfg.greedy, survival)
        return Draft(p.proposed, scored, gated, cands, p.speculate, p.propose_s, score_s if scored else 0.0)

    def tree_work(self, r: Request, d: Draft, count: int) -> TreeWork:
        keep = r.sched.kept(d.proposed, d.cands, count)
        tree = d.proposed.subtree(keep)
        b, buf = len(r.behind), compile_tree(tree.after(r.behind).parents, r.target.length)
        children = tuple(tuple(c - b for c in ch) for ch in buf.children[b:])
        seq = SeqInput(r.target.cache, (*r.behind, *tree.tokens), tuple(buf.position_ids[0].tolist()), buf.ancestors)
        return TreeWork(keep, tree, children, seq)

    def commit(self, r: Request, d: Draft, work: TreeWork | None, logits: torch.Tensor | None,
               verify_s: float, hidden: torch.Tensor | None = None) -> int:
        """Verify one request's tree against its logits [len(behind) + N, V], commit, stream, recover; returns the
        tokens committed. `hidden` [len(behind) + N, k*C]: the target's hidden states there, for a drafter that
        wants them."""
        t = time.perf_counter()
        if d.gated:  # lossy gate mode: the verifier alone accepts; the target runs these tokens in its next pass
            keep, tree = list(range(len(d.proposed))), d.proposed
            path = d.gated
            verdict = Verdict((0, *path[:-1]), tuple(tree.tokens[i] for i in path[:-1]), tree.tokens[path[-1]])
            r.behind += [tree.tokens[i] for i in verdict.path]
        else:
            b, keep, tree = len(r.behind), work.keep, work.tree
            verdict = verify(tree, work.children, logits[b:], r.cfg, r.gen)
            kept_rows = list(range(b)) + [b + i for i in verdict.path]
            r.target.commit(kept_rows)
            if hidden is not None:
                r.drafter.observe(hidden[kept_rows])  # [committed rows, k*C]
            r.behind = []
        if r.drafter is not None:
            r.drafter.commit(d.proposed, verdict.renumber(keep))
        verify_s += time.perf_counter() - t
        r.stats.add_times(d.propose_s, d.score_s, verify_s, d.scored is not None)
        if not d.gated:
            if r.record:
                r.verified.append(Verified(d.proposed, d.scored, verdict.renumber(keep)))
            r.sched.record(tree, verdict, d.speculated, d.propose_s + d.score_s, verify_s,
                           d.score_s if d.scored is not None else None, d.proposed)
        r.root = verdict.bonus
        emit(r, [*verdict.accepted, r.root], draft=0 if d.gated else len(tree) - 1,
             accepted=0 if d.gated else len(verdict.accepted), gated=len(d.gated))
        return len(verdict.accepted) + 1

    def prefill(self, joining: list[Request]) -> None:
        """Run the next chunk of joining requests' prompts (oldest first, `prefill_tokens` in all) in one forward;
        a request whose prompt is done picks its first token (free) and starts its drafter."""
        left, chunks = self.cfg.prefill_tokens, []
        for r in joining:
            n = min(len(r.prompt_ids) - r.prefilled, left)
            if n <= 0:
                break
            last = r.prefilled + n == len(r.prompt_ids)  # the prompt's last chunk: its last row's logits only
            chunks.append((r, chain_input(r.target.cache, r.prompt_ids[r.prefilled:r.prefilled + n],
                                          (n - 1,) if last else ())))
            left -= n
        if not chunks:
            return
        hidden = [] if any(wants_hidden(r) for r, _ in chunks) else None
        out = self.engine.forward_batch([s for _, s in chunks], hidden)
        for i, ((r, s), logits) in enumerate(zip(chunks, out)):  # logits [1 or 0, V]
            r.target.commit()
            if hidden is not None and wants_hidden(r):
                r.drafter.observe(hidden[i])  # the chunk's [n, k*C]: its reset takes the whole prompt's
            r.prefilled += len(s.tokens)
            if r.prefilled < len(r.prompt_ids):
                continue
            r.root = pick(logits[-1], r.cfg.sampling, r.gen)
            if r.drafter is not None:
                r.drafter.reset(r.prompt_ids, r.room + r.spec.tree_depth, r.target)
            r.stats.prefill_s = time.perf_counter() - r.t0
            emit(r, [r.root], draft=0, accepted=0)


def wants_hidden(r: Request) -> bool:
    """The request's drafter reads the target's hidden states (the learned draft head)."""
    return r.drafter is not None and r.drafter.wants_hidden


def verify(tree: DraftTree, children, logits: torch.Tensor, cfg: GenerateConfig, gen: torch.Generator) -> Verdict:
    """logits [N, V] on the engine's device: greedy takes their argmax there (N ids cross to the host); sampling
    processes them there and walks the tree on the host (the drafts' proposals and `gen` live there)."""
    if cfg.greedy:
        return verify_greedy(tree, children, logits)
    return verify_sampling(tree, children, processed_probs(logits, cfg.sampling).cpu(), gen)


def emit(r: Request, committed: list[int], draft: int, accepted: int, gated: int = 0) -> None:
    """Apply the stop rule to a step's committed tokens, count the step, put what is kept in the outbox."""
    kept = r.stop.add(committed)
    if kept:
        r.stats.record_step(draft, accepted, gated)
        r.stats.committed_tokens += len(kept)
        r.outbox += kept
